package hedge

import (
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// DefaultHalfLife is the LatencyTracker half-life used when none is given:
// an observation weighs half as much after a minute, so the tracker follows
// a change of regime within minutes and smooths over a burst of seconds.
const DefaultHalfLife = 60 * time.Second

// MinSamples is the decayed weight (a fresh observation weighs 1, one a
// half-life old 0.5) below which Quantile reports no answer. 20 is the
// fewest samples of which one lies above the 95th percentile.
const MinSamples = 20.0

// The histogram's range and resolution. Bucket k ≥ 1 holds the durations in
// (γ^(k-1), γ^k] milliseconds with γ = (1+α)/(1-α), and reports the value
// 2γ^k/(γ+1), which is within α of anything in the bucket (the logarithmic
// mapping of DDSketch: Masson, Rim and Lee, "DDSketch: A Fast and
// Fully-Mergeable Quantile Sketch with Relative-Error Guarantees", VLDB 2019).
const (
	// TrackerMin and TrackerMax bound the durations a LatencyTracker
	// resolves: shorter ones count as TrackerMin, longer ones as TrackerMax.
	TrackerMin = time.Millisecond
	TrackerMax = 10 * time.Minute
	// TrackerRelativeError is the bound α on the relative error of a
	// quantile for durations within [TrackerMin, TrackerMax].
	TrackerRelativeError = 0.05
)

var (
	gamma    = (1 + TrackerRelativeError) / (1 - TrackerRelativeError)
	invLnGam = 1 / math.Log(gamma)
	// numBuckets covers [TrackerMin, TrackerMax]: bucket 0 holds everything
	// up to TrackerMin, the last bucket everything from γ^(n-2) ms up.
	numBuckets = int(math.Ceil(math.Log(float64(TrackerMax/TrackerMin))*invLnGam)) + 1
	// bucketValue[k] is the duration bucket k reports.
	bucketValue = func() []time.Duration {
		v := make([]time.Duration, numBuckets)
		for k := range v {
			ms := 2 * math.Pow(gamma, float64(k)) / (gamma + 1)
			v[k] = time.Duration(ms * float64(time.Millisecond))
		}
		return v
	}()
)

// maxBuckets is numBuckets as a constant, for the slab's array: a static
// assertion in init checks that they agree.
const maxBuckets = 134

func init() {
	if numBuckets != maxBuckets {
		panic("hedge: maxBuckets must be " + strconv.Itoa(numBuckets))
	}
}

// rescaleAfter is the age of a slab's landmark, in half-lives, at which
// Observe starts a new slab: forward-decay weights reach 2^512, far inside
// float64's range (2^1023), and this happens once every 8.5 hours at the
// default half-life.
const rescaleAfter = 512

// LatencyTracker is a rolling, time-decayed histogram of observed durations
// (time to first token, per pool and model: the caller keys the trackers),
// answering percentile queries with relative error ≤ TrackerRelativeError.
//
// Decay is exponential with the half-life given to NewLatencyTracker: an
// observation's weight halves every half-life, continuously, and a quantile
// is that of the weighted observations. It is computed as forward decay
// (Cormode, Shkapenyuk, Srivastava and Xu, "Forward Decay: A Practical Time
// Decay Model for Streaming Systems", ICDE 2009): each observation is added
// with weight 2^(age of the landmark / half-life), growing with time, so that
// nothing old is ever touched; queries divide by the current weight. When
// weights grow too large the histogram is copied, scaled down, onto a new
// landmark (every 512 half-lives).
//
// How fast a percentile follows a change: when latency rises, the p95 starts
// to move as soon as the new observations weigh over 5% of the total (0.07
// half-lives, 4s at the default) and is at the new regime's p95 within about
// half a half-life (TestP95FollowsRegimeChange: 150ms → 2s at 10 samples/s,
// within 10% after 39s); when latency falls, the p95 comes down only once the
// old observations weigh under 5%, after log2(20) ≈ 4.3 half-lives (about
// 4.5 minutes at the default). So hedges fire later at once when a fleet
// slows, and earlier again only gradually.
//
// The alternative, a ring of sub-window histograms, forgets in steps and
// costs a sum over every sub-window per query; the decayed histogram is one
// array of 134 buckets (1 KiB), O(1) per observation and per-bucket per
// query.
//
// Observe, Quantile and Count are safe for concurrent use; Observe takes no
// lock and allocates nothing (it adds to one bucket with a compare-and-swap).
// The zero value is not usable: use NewLatencyTracker.
type LatencyTracker struct {
	clock    clock.Reader
	base     time.Time // landmarks are offsets from base
	invHalf  float64   // 1 / half-life in nanoseconds
	halfLife time.Duration
	cur      atomic.Pointer[slab]
	mu       sync.Mutex // serialises rescales
}

// slab is the histogram relative to one landmark. It is replaced, never
// reset, so an Observe that loaded an old slab adds to an orphan instead of
// corrupting the new one.
type slab struct {
	landmark time.Duration // offset from base; immutable
	// w holds float64 bits: the forward-decayed weight of each bucket.
	w [maxBuckets]atomic.Uint64
}

// NewLatencyTracker returns an empty tracker whose observations lose half
// their weight every halfLife (DefaultHalfLife if halfLife ≤ 0), reading time
// from clk (clock.Real if nil).
func NewLatencyTracker(halfLife time.Duration, clk clock.Reader) *LatencyTracker {
	if halfLife <= 0 {
		halfLife = DefaultHalfLife
	}
	if clk == nil {
		clk = clock.Real
	}
	t := &LatencyTracker{clock: clk, base: clk.Now(), halfLife: halfLife, invHalf: 1 / float64(halfLife)}
	t.cur.Store(new(slab))
	return t
}

// HalfLife returns the tracker's half-life.
func (t *LatencyTracker) HalfLife() time.Duration { return t.halfLife }

// bucketOf returns the bucket index of d.
func bucketOf(d time.Duration) int {
	if d <= TrackerMin {
		return 0
	}
	k := int(math.Ceil(math.Log(float64(d)/float64(TrackerMin)) * invLnGam))
	return min(k, numBuckets-1)
}

// exponent returns the age of s's landmark at now, in half-lives.
func (t *LatencyTracker) exponent(s *slab, now time.Time) float64 {
	return float64(now.Sub(t.base)-s.landmark) * t.invHalf
}

// Observe records one duration (a TTFT) at the clock's current time.
// Durations outside [TrackerMin, TrackerMax] count as the nearest bound.
// It takes no lock and allocates nothing.
func (t *LatencyTracker) Observe(d time.Duration) {
	now := t.clock.Now()
	s := t.cur.Load()
	e := t.exponent(s, now)
	if e > rescaleAfter {
		s = t.rescale(now)
		e = t.exponent(s, now)
	}
	addFloat(&s.w[bucketOf(d)], math.Exp2(e))
}

// rescale moves the histogram onto a landmark at now and returns the new
// slab. Observations added to the old slab by goroutines that loaded it
// before the switch and add after their bucket was copied are lost: a few
// at most, once every rescaleAfter half-lives.
func (t *LatencyTracker) rescale(now time.Time) *slab {
	t.mu.Lock()
	defer t.mu.Unlock()
	old := t.cur.Load()
	if t.exponent(old, now) <= rescaleAfter {
		return old // another goroutine did it
	}
	ns := &slab{landmark: now.Sub(t.base)}
	f := math.Exp2(-t.exponent(old, now)) // 0 after a long idle: all forgotten
	for i := range old.w {
		if v := math.Float64frombits(old.w[i].Load()) * f; v != 0 {
			ns.w[i].Store(math.Float64bits(v))
		}
	}
	t.cur.Store(ns)
	return ns
}

// addFloat adds v to the float64 held in a.
func addFloat(a *atomic.Uint64, v float64) {
	for {
		old := a.Load()
		if a.CompareAndSwap(old, math.Float64bits(math.Float64frombits(old)+v)) {
			return
		}
	}
}

// Count returns the decayed number of observations: each weighs 1 when made
// and half as much every half-life after.
func (t *LatencyTracker) Count() float64 {
	s := t.cur.Load()
	var sum float64
	for i := range s.w {
		sum += math.Float64frombits(s.w[i].Load())
	}
	return sum * math.Exp2(-t.exponent(s, t.clock.Now()))
}

// Quantile returns the q-quantile (0.95 for p95) of the decayed
// observations, within TrackerRelativeError of the true weighted quantile
// for durations in [TrackerMin, TrackerMax]. It returns false when q is not
// in [0, 1] or the decayed weight is below MinSamples. It takes no lock and
// allocates nothing; it reads the 134 buckets twice.
func (t *LatencyTracker) Quantile(q float64) (time.Duration, bool) {
	if !(q >= 0 && q <= 1) {
		return 0, false
	}
	s := t.cur.Load()
	var w [maxBuckets]float64
	var sum float64
	for i := range s.w {
		w[i] = math.Float64frombits(s.w[i].Load())
		sum += w[i]
	}
	if sum*math.Exp2(-t.exponent(s, t.clock.Now())) < MinSamples {
		return 0, false
	}
	rank := q * sum
	var cum float64
	for i, v := range w {
		cum += v
		if cum >= rank && cum > 0 {
			return bucketValue[i], true
		}
	}
	// Rounding left rank a hair above the sum (q close to 1): the highest
	// non-empty bucket.
	for i := len(w) - 1; i >= 0; i-- {
		if w[i] > 0 {
			return bucketValue[i], true
		}
	}
	return 0, false
}
