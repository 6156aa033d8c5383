package fleet

import (
	"context"

	"github.com/redis/go-redis/v9"

	"github.com/llmproxy/caddy-llm-proxy/admission"
)

// Resize implements admission.Resizer: one script on Redis for a hold
// taken there, the local fallback's own for one decided locally. A
// resize whose effect is unknown (a timeout after sending) reports a
// shrink as done and a growth as refused: either way settlement takes
// back what the hold in Redis says is reserved, so nothing is counted
// twice.
func (l *Limits) Resize(q *admission.Quota, h *admission.Hold, reserved int64) bool {
	switch ref := h.Ref.(type) {
	case *admission.LocalLimits:
		share := *q
		if n := l.c.Config().ExpectedInstances; n > 1 && share.TPM > 0 {
			share.TPM = max(share.TPM/n, 1)
		}
		return ref.Resize(&share, h, reserved)
	case *remoteHold:
		var v int64
		err := l.c.Do(context.Background(), "limits_resize", func(ctx context.Context, r redis.Cmdable) error {
			k := l.keys(ref.tenant, h.ID)
			var err error
			v, err = resizeScript.Run(ctx, r, []string{k[0], k[2], k[3]}, q.TPM, reserved, l.slotMs, l.slots).Int64()
			return err
		})
		if err != nil {
			return reserved <= h.Reserved
		}
		if v < 0 {
			return false
		}
		h.Reserved = reserved
		return true
	}
	return false
}

var _ admission.Resizer = (*Limits)(nil)
