package mockllm

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/common/expfmt"
	"go.uber.org/zap"
)

// MetricsFault names what a replica's GET /metrics does, independently of
// its completion Behavior.
type MetricsFault string

// The /metrics faults.
const (
	// MetricsNormal answers with the live metrics ("normal" in a spec).
	MetricsNormal MetricsFault = ""
	// MetricsFrozen answers with the body captured when the mode was set:
	// the same bytes on every scrape, whatever the replica does meanwhile.
	MetricsFrozen MetricsFault = "frozen"
	// MetricsHang never answers; the handler returns only when the
	// client's request context ends or the replica stops.
	MetricsHang MetricsFault = "hang"
	// MetricsStatus answers MetricsMode.Status with a short text body.
	MetricsStatus MetricsFault = "status"
	// MetricsSlow waits MetricsMode.Delay, then answers normally (with the
	// metrics of that moment); a client that goes away ends the wait.
	MetricsSlow MetricsFault = "slow"
)

// KVMetric chooses the name under which /metrics exposes the KV-cache
// usage gauge.
type KVMetric string

// The KV-cache metric names.
const (
	// KVNew exposes only vllm:kv_cache_usage_perc, the V1 engine's name
	// ("new" in a spec; the default).
	KVNew KVMetric = ""
	// KVOld exposes only vllm:gpu_cache_usage_perc, the V0 engine's name.
	KVOld KVMetric = "old"
	// KVBoth exposes both names, with the same value.
	KVBoth KVMetric = "both"
	// KVNone exposes no KV-cache usage at all.
	KVNone KVMetric = "none"
)

// MetricsMode is how a replica answers GET /metrics: a fault and the name
// of the KV-cache gauge. The zero value is the live metrics with
// vllm:kv_cache_usage_perc. Its text form (ParseMetricsMode, String) is a
// comma-separated list such as "frozen,kv=old" or "slow=2s".
type MetricsMode struct {
	// Fault is what the endpoint does; MetricsNormal by default.
	Fault MetricsFault
	// Status is the HTTP status of MetricsStatus (400-599).
	Status int
	// Delay is how long MetricsSlow waits before answering (above 0, at
	// most 24h).
	Delay time.Duration
	// KV is the KV-cache metric name exposed (normal, slow and frozen
	// answers); KVNew by default.
	KV KVMetric
}

// String formats m as ParseMetricsMode accepts it; "normal" for the zero
// MetricsMode.
func (m MetricsMode) String() string {
	var items []string
	switch m.Fault {
	case MetricsNormal:
	case MetricsStatus:
		items = append(items, "status="+strconv.Itoa(m.Status))
	case MetricsSlow:
		items = append(items, "slow="+m.Delay.String())
	default:
		items = append(items, string(m.Fault))
	}
	if m.KV != KVNew {
		items = append(items, "kv="+string(m.KV))
	}
	if len(items) == 0 {
		return "normal"
	}
	return strings.Join(items, ",")
}

// ParseMetricsMode parses a /metrics mode spec: comma-separated items, at
// most one fault and one kv. "" yields the zero MetricsMode.
//
//	normal          live metrics (the default)
//	frozen          the body captured when the mode was set, on every scrape
//	hang            never answer, until the client goes away
//	status=CODE     answer CODE (400-599) with a short text body
//	slow=DURATION   wait DURATION (> 0), then answer normally
//	kv=new          expose vllm:kv_cache_usage_perc only (the default)
//	kv=old          expose vllm:gpu_cache_usage_perc only
//	kv=both         expose both
//	kv=none         expose no KV-cache usage
func ParseMetricsMode(s string) (MetricsMode, error) {
	var m MetricsMode
	s = strings.TrimSpace(s)
	if s == "" {
		return m, nil
	}
	var fault, kv bool
	for item := range strings.SplitSeq(s, ",") {
		k, v, hasValue := strings.Cut(strings.TrimSpace(item), "=")
		k = strings.ToLower(strings.TrimSpace(k))
		v = strings.TrimSpace(v)
		if k == "kv" {
			if kv {
				return MetricsMode{}, fmt.Errorf("metrics mode %q: kv given twice", s)
			}
			kv = true
			switch KVMetric(strings.ToLower(v)) {
			case "new":
				m.KV = KVNew
			case KVOld, KVBoth, KVNone:
				m.KV = KVMetric(strings.ToLower(v))
			default:
				return MetricsMode{}, fmt.Errorf("metrics mode %q: kv=%q: want new, old, both or none", s, v)
			}
			continue
		}
		if fault {
			return MetricsMode{}, fmt.Errorf("metrics mode %q: two faults (%s is the second)", s, k)
		}
		fault = true
		if err := m.setFault(k, v, hasValue); err != nil {
			return MetricsMode{}, fmt.Errorf("metrics mode %q: %w", s, err)
		}
	}
	if err := m.Validate(); err != nil {
		return MetricsMode{}, fmt.Errorf("metrics mode %q: %w", s, err)
	}
	return m, nil
}

// setFault applies the fault item k[=v] of a spec.
func (m *MetricsMode) setFault(k, v string, hasValue bool) error {
	switch k {
	case "normal", "frozen", "hang":
		if hasValue {
			return fmt.Errorf("%s takes no value", k)
		}
		if k != "normal" {
			m.Fault = MetricsFault(k)
		}
		return nil
	case "status":
		n, err := parseStatus(v)
		if err != nil {
			return err
		}
		m.Fault, m.Status = MetricsStatus, n
		return nil
	case "slow":
		d, err := parseDuration(v)
		if err != nil {
			return fmt.Errorf("slow=%q: %w", v, err)
		}
		m.Fault, m.Delay = MetricsSlow, d
		return nil
	}
	return fmt.Errorf("unknown item %q", k)
}

// Validate reports a fault that is unknown or lacks its value, a value
// given to another fault, and an unknown KV name.
func (m MetricsMode) Validate() error {
	switch m.Fault {
	case MetricsNormal, MetricsFrozen, MetricsHang:
	case MetricsStatus:
		if m.Status < 400 || m.Status > 599 {
			return fmt.Errorf("status %d: want 400-599", m.Status)
		}
	case MetricsSlow:
		if m.Delay <= 0 || m.Delay > maxDuration {
			return fmt.Errorf("slow %s: want (0, %s]", m.Delay, maxDuration)
		}
	default:
		return fmt.Errorf("unknown metrics fault %q", m.Fault)
	}
	switch {
	case m.Status != 0 && m.Fault != MetricsStatus:
		return errors.New("a status needs the status fault")
	case m.Delay != 0 && m.Fault != MetricsSlow:
		return errors.New("a delay needs the slow fault")
	}
	switch m.KV {
	case KVNew, KVOld, KVBoth, KVNone:
	default:
		return fmt.Errorf("unknown kv metric %q", m.KV)
	}
	return nil
}

// MetricsMode returns how the replica answers GET /metrics.
func (r *Replica) MetricsMode() MetricsMode {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.metricsMode
}

// SetMetricsMode changes how the replica answers GET /metrics from now
// on; scrapes in progress keep their mode. A frozen mode captures the body
// now, each time it is set. A mode that does not validate is refused and
// the current one kept.
func (r *Replica) SetMetricsMode(m MetricsMode) error {
	if err := m.Validate(); err != nil {
		return fmt.Errorf("replica %d: metrics mode: %w", r.index, err)
	}
	var frozen []byte
	if m.Fault == MetricsFrozen {
		var err error
		if frozen, err = r.metrics.render(m.KV); err != nil {
			return fmt.Errorf("replica %d: freeze metrics: %w", r.index, err)
		}
	}
	r.mu.Lock()
	r.metricsMode, r.frozenMetrics = m, frozen
	r.mu.Unlock()
	r.log.Info("metrics mode changed", zap.Int("replica", r.index), zap.Stringer("mode", m))
	return nil
}

// serveMetrics answers GET /metrics according to the MetricsMode.
func (r *Replica) serveMetrics(w http.ResponseWriter, req *http.Request) {
	r.mu.Lock()
	m, frozen := r.metricsMode, r.frozenMetrics
	r.stats.scrapes++
	r.scrapesInFlight++
	r.stats.maxScrapes = max(r.stats.maxScrapes, r.scrapesInFlight)
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		r.scrapesInFlight--
		r.mu.Unlock()
	}()

	switch m.Fault {
	case MetricsHang:
		<-req.Context().Done()
		return
	case MetricsStatus:
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(m.Status)
		fmt.Fprintf(w, "mockllm: metrics fault status=%d\n", m.Status)
		return
	case MetricsFrozen:
		w.Header().Set("Content-Type", string(expfmt.FmtText))
		w.Header().Set("Content-Length", strconv.Itoa(len(frozen)))
		w.Write(frozen)
		return
	case MetricsSlow:
		t := time.NewTimer(m.Delay)
		defer t.Stop()
		select {
		case <-req.Context().Done():
			return
		case <-t.C:
		}
	}
	r.metrics.handler(m.KV).ServeHTTP(w, req)
}

func (r *Replica) serveGetMetricsMode(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	io.WriteString(w, r.MetricsMode().String()+"\n")
}

// servePutMetricsMode sets the MetricsMode from a spec body ("hang",
// "frozen,kv=old").
func (r *Replica) servePutMetricsMode(w http.ResponseWriter, req *http.Request) {
	body, err := io.ReadAll(io.LimitReader(req.Body, 1<<16))
	if err != nil {
		writeError(w, http.StatusBadRequest, "read body: "+err.Error())
		return
	}
	m, err := ParseMetricsMode(string(body))
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if err := r.SetMetricsMode(m); err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	io.WriteString(w, m.String()+"\n")
}
