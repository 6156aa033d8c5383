package admission

import "time"

// The rate limits count over a rolling minute of slots one second wide: a
// request or token counted at time t is forgotten 59 to 60 seconds later,
// one second at a time. rolling's lock-free ten-bucket ring would forget six
// seconds at a time and adds only ones; a tenant's counts need adding and
// removing token amounts together with a concurrency check, all under the
// tenant's lock, so they live in this small ring instead.
const (
	slotWidth = time.Second
	slots     = 60
	// windowLen is the rolling window of rpm and tpm.
	windowLen = slots * slotWidth
)

type slot struct {
	ep         int64 // the slot's epoch: seconds since base
	reqs, toks int64
}

// minuteWindow is a tenant's request and token counts over the rolling
// minute. Not safe for concurrent use: the tenant's lock guards it. It
// advances lazily, when given a later time; no timer, no goroutine.
type minuteWindow struct {
	base       time.Time
	cur        int64 // the newest epoch advanced to
	reqs, toks int64 // totals of the window's slots
	s          [slots]slot
}

// advance moves the window to now (a time before the newest one seen
// counts as that one) and returns the current epoch.
func (w *minuteWindow) advance(now time.Time) int64 {
	d := now.Sub(w.base)
	if d < 0 {
		d = 0
	}
	ep := int64(d / slotWidth)
	if ep <= w.cur {
		return w.cur
	}
	for e := max(w.cur+1, ep-slots+1); e <= ep; e++ {
		s := &w.s[e%slots]
		w.reqs -= s.reqs
		w.toks -= s.toks
		*s = slot{ep: e}
	}
	w.cur = ep
	return ep
}

// add counts reqs requests and toks tokens in the current slot.
func (w *minuteWindow) add(reqs, toks int64) {
	s := &w.s[w.cur%slots]
	s.reqs += reqs
	s.toks += toks
	w.reqs += reqs
	w.toks += toks
}

// inWindow reports whether the slot of epoch e is still counted.
func (w *minuteWindow) inWindow(e int64) bool { return e <= w.cur && e > w.cur-slots }

// remove takes back reqs requests and toks tokens counted in epoch e, if e
// is still in the window (counts older than the window are forgotten
// already).
func (w *minuteWindow) remove(e, reqs, toks int64) {
	if !w.inWindow(e) {
		return
	}
	s := &w.s[e%slots]
	reqs, toks = min(reqs, s.reqs), min(toks, s.toks)
	s.reqs -= reqs
	s.toks -= toks
	w.reqs -= reqs
	w.toks -= toks
}

// oldest returns the oldest epoch in the window (epochs start at 0).
func (w *minuteWindow) oldest() int64 { return max(0, w.cur-slots+1) }

// leaves returns the time at which the slot of epoch e leaves the window.
func (w *minuteWindow) leaves(e int64) time.Time {
	return w.base.Add(time.Duration(e+slots) * slotWidth)
}

// field selects the requests or the tokens of a slot.
type field uint8

const (
	fieldReqs field = iota
	fieldToks
)

func (s *slot) get(f field) int64 {
	if f == fieldReqs {
		return s.reqs
	}
	return s.toks
}

func (w *minuteWindow) total(f field) int64 {
	if f == fieldReqs {
		return w.reqs
	}
	return w.toks
}

// until returns how long until the window's count of f is at most target,
// as slots leave it oldest first (at least one slot width when it is over
// target now: the count cannot drop sooner). Counts of requests still in
// flight are assumed to stay.
func (w *minuteWindow) until(now time.Time, f field, target int64) time.Duration {
	n := w.total(f)
	if n <= target {
		return 0
	}
	for e := w.oldest(); e <= w.cur; e++ {
		n -= w.s[e%slots].get(f)
		if n <= target {
			return max(w.leaves(e).Sub(now), slotWidth/1000)
		}
	}
	// Only tokens settling can bring it lower: say a full window.
	return max(w.leaves(w.cur).Sub(now), slotWidth/1000)
}

// reset returns how long until the window's count of f is 0: until its
// newest non-empty slot leaves.
func (w *minuteWindow) reset(now time.Time, f field) time.Duration {
	for e := w.cur; e >= w.oldest(); e-- {
		if w.s[e%slots].get(f) != 0 {
			return max(w.leaves(e).Sub(now), 0)
		}
	}
	return 0
}
