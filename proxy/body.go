package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/llmproxy/caddy-llm-proxy/api"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// DefaultMaxBufferedBodies is the body budget's size when none is
// configured: 256 MiB, sixteen bodies at the 16 MiB default limit.
const DefaultMaxBufferedBodies int64 = 256 << 20

// DefaultBodyBudgetWait is how long a request whose body does not fit the
// budget waits for room before it is refused with 503.
const DefaultBodyBudgetWait = time.Second

// ErrBodyBudget is returned (wrapped) when a body does not fit the body
// budget within the wait.
var ErrBodyBudget = errors.New("request body memory exhausted")

// BodyBudget bounds the memory that buffered request bodies hold at once,
// process-wide: every body is charged, in bytes of the buffer that holds it,
// before a byte of it is read, and given back when its request ends. A
// request whose body does not fit waits up to its wait for room (FIFO, as
// golang.org/x/sync/semaphore.Weighted), then is refused: the gateway
// answers 503 instead of running out of memory. It is safe for concurrent
// use; the zero value is not usable: use NewBodyBudget.
type BodyBudget struct {
	sem   *semaphore.Weighted
	size  int64
	wait  time.Duration
	inUse atomic.Int64
}

// NewBodyBudget returns a budget of size bytes (> 0) whose requests wait at
// most wait (≥ 0; 0 refuses at once) for room.
func NewBodyBudget(size int64, wait time.Duration) (*BodyBudget, error) {
	if size <= 0 {
		return nil, fmt.Errorf("body budget: size %d bytes: want a positive size", size)
	}
	if wait < 0 {
		return nil, fmt.Errorf("body budget: negative wait %v", wait)
	}
	return &BodyBudget{sem: semaphore.NewWeighted(size), size: size, wait: wait}, nil
}

// Size is the budget in bytes.
func (b *BodyBudget) Size() int64 { return b.size }

// InUse is the number of bytes charged now.
func (b *BodyBudget) InUse() int64 { return b.inUse.Load() }

// acquire charges n bytes, waiting up to the budget's wait on clk or
// until ctx ends. It returns an error wrapping ErrBodyBudget when there was
// no room in time, or ctx's cause when ctx ended first. n larger than the
// whole budget is refused with ErrBodyTooLarge: it can never fit.
func (b *BodyBudget) acquire(ctx context.Context, clk clock.Clock, n int64) error {
	if n <= 0 {
		return nil
	}
	if n > b.size {
		return fmt.Errorf("%w: %d bytes do not fit max_buffered_bodies %d", ErrBodyTooLarge, n, b.size)
	}
	if b.sem.TryAcquire(n) {
		b.inUse.Add(n)
		return nil
	}
	if b.wait <= 0 {
		return fmt.Errorf("%w: %d bytes wanted, %d of %d in use", ErrBodyBudget, n, b.InUse(), b.size)
	}
	wctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	t := clk.AfterFunc(b.wait, func() { cancel(ErrBodyBudget) })
	defer t.Stop()
	if err := b.sem.Acquire(wctx, n); err != nil {
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		return fmt.Errorf("%w: %d bytes wanted, none free within %v (%d of %d in use)", ErrBodyBudget, n, b.wait, b.InUse(), b.size)
	}
	b.inUse.Add(n)
	return nil
}

// release gives n bytes back.
func (b *BodyBudget) release(n int64) {
	if n <= 0 {
		return
	}
	b.inUse.Add(-n)
	b.sem.Release(n)
}

// usageSlack is the room a buffer keeps after the body for the
// stream_options edit of RequestUsage, so that it is made in place: the
// longest insertion, `,"stream_options":{"include_usage":true}`, is 40
// bytes.
const usageSlack = 48

// firstChunk is the most a read allocates before the body's bytes arrive:
// a client that declares 16 MiB and sends a byte costs this much memory
// (the budget is charged the declared length, though).
const firstChunk = 256 << 10

// Body is a request body read into memory once, charged to a BodyBudget
// until its request ends. It is also an io.ReadCloser over those bytes: the
// llm_model matcher puts it in place of the request's Body, so that the
// handlers after it read the identical bytes and llm_proxy takes them
// without reading (or charging) again. Read and Close are for one goroutine,
// as a request body's.
type Body struct {
	b   []byte
	off int
	// info is the parse of b by parsedAs, when parsed (by the matcher).
	info     RequestInfo
	parseErr error
	parsedAs api.API
	// layout is where info's parse found the body's fields (info.Layout
	// points here: a parse allocates nothing for it).
	layout api.Layout

	budget   *BodyBudget
	charged  int64
	released sync.Once
	// probe is readBody's one-byte read past a full buffer (here, not on
	// readBody's stack, from which a Read through an interface moves it
	// to the heap).
	probe [1]byte
}

// Bytes returns the whole body, whatever has been read of it.
func (b *Body) Bytes() []byte { return b.b }

// Read reads the body from where the last Read stopped.
func (b *Body) Read(p []byte) (int, error) {
	if b.off >= len(b.b) {
		return 0, io.EOF
	}
	n := copy(p, b.b[b.off:])
	b.off += n
	return n, nil
}

// Close does nothing: the bytes stay charged until the request ends.
func (b *Body) Close() error { return nil }

// untouched reports that nobody has read from b yet.
func (b *Body) untouched() bool { return b.off == 0 }

// Parse returns the body parsed as a's request (a.ParseRequest), computed
// once for a given API (a body is parsed again only when a handler reads
// it as another API than the matcher did).
func (b *Body) Parse(a api.API) (RequestInfo, error) {
	if b.parsedAs != a {
		b.info, b.parseErr = api.ParseInto(a, b.b, &b.layout)
		b.parsedAs = a
	}
	return b.info, b.parseErr
}

// drop lets go of the body's bytes and gives its charge back (Release):
// Read then returns io.EOF.
func (b *Body) drop() {
	b.b, b.off = nil, 0
	b.Release()
}

// Release gives the body's charge back to its budget, once; later calls do
// nothing.
func (b *Body) Release() {
	b.released.Do(func() {
		if b.budget != nil {
			b.budget.release(b.charged)
		}
	})
}

// BodyLimits bound a body read.
type BodyLimits struct {
	// Limit is the largest body accepted, in bytes (> 0).
	Limit int64
	// Budget, when set, is charged for the body's buffer before it is read.
	Budget *BodyBudget
	// Clock times the budget's wait; nil is the real clock.
	Clock clock.Clock
}

// BufferBody reads r's body into one Body bounded by lim, charged to
// lim.Budget, releases the charge when ctx ends (the request's context:
// net/http cancels it when ServeHTTP returns) and puts the Body in place of
// r.Body, so that whoever comes next reads the same bytes. A body that is
// already a *Body nobody has read from is returned as it is (a second
// matcher, or llm_proxy after the matcher, reads nothing again); if it is
// over lim.Limit the error wraps ErrBodyTooLarge. Errors wrap
// ErrBodyTooLarge (413), ErrBodyBudget (503), ctx's error or the read
// error; r.Body is then left as it was.
func BufferBody(ctx context.Context, r *http.Request, lim BodyLimits) (*Body, error) {
	b, fresh, err := bufferBody(ctx, r, lim)
	if fresh {
		context.AfterFunc(ctx, b.Release)
	}
	return b, err
}

// bufferBody is BufferBody without the release: fresh is true when it read
// (and charged) the body, which the caller then releases. The lifecycle's
// read uses it and releases in finish: context.AfterFunc cost six
// allocations per request.
func bufferBody(ctx context.Context, r *http.Request, lim BodyLimits) (b *Body, fresh bool, err error) {
	if b, ok := r.Body.(*Body); ok && b.untouched() {
		if int64(len(b.b)) > lim.Limit {
			return nil, false, fmt.Errorf("%w: %d bytes, limit %d", ErrBodyTooLarge, len(b.b), lim.Limit)
		}
		return b, false, nil
	}
	b, err = readBody(ctx, r, lim)
	if err != nil {
		return nil, false, err
	}
	r.Body = b
	return b, true, nil
}

// readBody reads r's body into one buffer of the body's size, charging
// lim.Budget for it before reading. A declared Content-Length over the
// limit is refused before reading or charging. With a declared length the
// buffer is charged once for the whole length, and allocated at most
// firstChunk before the bytes arrive, then once at its full size; without
// one (or past it) the buffer doubles from firstChunk, each growth charged
// before it is made. Every buffer keeps usageSlack bytes of room after the
// body. On error nothing stays charged.
func readBody(ctx context.Context, r *http.Request, lim BodyLimits) (*Body, error) {
	b := &Body{budget: lim.Budget}
	if r.Body == nil || r.Body == http.NoBody {
		return b, nil
	}
	limit := lim.Limit
	if r.ContentLength > limit {
		return nil, fmt.Errorf("%w: declared %d bytes, limit %d", ErrBodyTooLarge, r.ContentLength, limit)
	}
	clk := clock.Or(lim.Clock)
	charge := func(n int64) error {
		if lim.Budget == nil || n <= 0 {
			return nil
		}
		if err := lim.Budget.acquire(ctx, clk, n); err != nil {
			return err
		}
		b.charged += n
		return nil
	}
	fail := func(err error) (*Body, error) {
		b.Release()
		return nil, err
	}
	// full is the buffer's size for the declared length, 0 without one;
	// ceiling is the largest buffer, one byte over the limit showing that
	// a body is too large.
	full, ceiling := int64(0), limit+1+usageSlack
	size := min(int64(firstChunk), ceiling)
	if r.ContentLength > 0 {
		full = r.ContentLength + usageSlack
		size = min(full, size)
		if err := charge(full); err != nil {
			return fail(err)
		}
	} else if err := charge(size); err != nil {
		return fail(err)
	}
	buf := make([]byte, 0, size)
	grow := func() error {
		next := full
		if int64(cap(buf)) >= full {
			next = min(2*int64(cap(buf)), ceiling)
			if err := charge(next - int64(cap(buf))); err != nil {
				return err
			}
		}
		grown := make([]byte, len(buf), next)
		copy(grown, buf)
		buf = grown
		return nil
	}
	probe := b.probe[:]
	for {
		if int64(len(buf)) > limit {
			return fail(fmt.Errorf("%w: more than %d bytes", ErrBodyTooLarge, limit))
		}
		var n int
		var err error
		if room := cap(buf) - usageSlack; len(buf) < room {
			n, err = r.Body.Read(buf[len(buf):room])
			buf = buf[:len(buf)+n]
		} else {
			// The buffer is full: grow only if a byte more arrives
			// (a body of exactly its declared length never grows).
			if n, err = r.Body.Read(probe); n > 0 {
				if gerr := grow(); gerr != nil {
					return fail(gerr)
				}
				buf = append(buf, probe[0])
			}
		}
		if err == io.EOF {
			if int64(len(buf)) > limit {
				return fail(fmt.Errorf("%w: more than %d bytes", ErrBodyTooLarge, limit))
			}
			b.b = buf
			return b, nil
		}
		if err != nil {
			return fail(fmt.Errorf("reading request body: %w", err))
		}
	}
}

// ParsesBody reports whether the lifecycle parses r's body as JSON (every
// body except multipart forms and binary or media types): the bodies whose
// model the llm_model matcher reads.
func ParsesBody(r *http.Request) bool { return isJSONRequest(r) }
