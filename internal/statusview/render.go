package statusview

import (
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/dustin/go-humanize"
)

// DefaultWidth is the line width Render keeps to when Options.Width is 0:
// a classic terminal's 80 columns.
const DefaultWidth = 80

// Options are how Render writes.
type Options struct {
	// Now is the time ages are computed against (time in a breaker state,
	// time since the last failure); zero means time.Now().
	Now time.Time
	// Width is the widest a line gets, in runes (cells are cut with "…");
	// 0 means DefaultWidth.
	Width int
	// Address is the admin endpoint shown in the heading; "" leaves it out.
	Address string
}

// Render writes s as text: a heading, then the UPSTREAMS, TENANTS and
// FLEET sections, no line wider than o.Width. Empty states say what they
// mean ("none"), never an empty table. It returns w's error.
func Render(w io.Writer, s Status, o Options) error {
	if o.Now.IsZero() {
		o.Now = time.Now()
	}
	if o.Width <= 0 {
		o.Width = DefaultWidth
	}
	var b strings.Builder
	head := "llm-proxy status"
	if o.Address != "" {
		head += " of " + clean(o.Address)
	}
	head += " at " + o.Now.UTC().Format("15:04:05 UTC")
	b.WriteString(cut(head, o.Width, false) + "\n\n")
	upstreams(&b, s, o)
	b.WriteByte('\n')
	tenants(&b, s, o)
	b.WriteByte('\n')
	fleetState(&b, s.Fleet, o)
	_, err := io.WriteString(w, b.String())
	return err
}

// upstreams writes one row per upstream (dial address) with its breaker,
// in-flight count, saturation score and scrape age and its breaker's last
// failure; breakers per model (scope model), and each handler's where the
// handlers' verdicts differ, follow as indented rows, and
// a note per set of handlers (sites) names the breakers that serve them.
// Notes below name scrape errors and fleet-wide openers.
func upstreams(b *strings.Builder, s Status, o Options) {
	type row struct {
		addr     string
		own      *Breaker  // the per-upstream breaker
		models   []Breaker // breakers per model, and of other policies
		sat      *Saturation
		inflight int64
	}
	rows := map[string]*row{}
	get := func(addr string) *row {
		r, ok := rows[addr]
		if !ok {
			r = &row{addr: addr}
			rows[addr] = r
		}
		return r
	}
	// Each handler has its own breaker on an upstream. Where they all
	// agree (one handler, or equal settings and evidence), the upstream's
	// row shows the state; where they differ, each handler's breaker
	// follows as an indented row named by its handler.
	perUpstream := map[string][]*Breaker{}
	// handlers names the handlers with a breaker on each upstream: where
	// there are several, a model's rows say whose breaker each is.
	handlers := map[string]map[string]bool{}
	for i := range s.Breakers {
		br := &s.Breakers[i]
		if handlers[br.Upstream] == nil {
			handlers[br.Upstream] = map[string]bool{}
		}
		handlers[br.Upstream][br.Handler] = true
		r := get(br.Upstream)
		r.inflight = max(r.inflight, br.Inflight)
		switch {
		case br.Model == "" && (br.Handler != "" || br.Policy == ""):
			perUpstream[br.Upstream] = append(perUpstream[br.Upstream], br)
		default:
			r.models = append(r.models, *br)
		}
	}
	for addr, brs := range perUpstream {
		r := get(addr)
		if slices.IndexFunc(brs, func(b *Breaker) bool { return b.State != brs[0].State }) < 0 {
			r.own = brs[0]
			continue
		}
		for _, br := range brs {
			r.models = append(r.models, *br)
		}
	}
	for i := range s.Saturation {
		r := get(s.Saturation[i].Upstream)
		r.sat = &s.Saturation[i]
		r.inflight = max(r.inflight, s.Saturation[i].Inflight)
	}
	fmt.Fprintf(b, "UPSTREAMS (%d)\n", len(rows))
	if len(rows) == 0 {
		b.WriteString("  none: no llm_proxy handler has upstreams yet\n")
		return
	}
	addrs := make([]string, 0, len(rows))
	for a := range rows {
		addrs = append(addrs, a)
	}
	slices.Sort(addrs)

	t := table{cols: []column{
		{head: "UPSTREAM", max: 21, addr: true},
		{head: "BREAKER", max: 18},
		{head: "INFL", max: 5, right: true},
		{head: "SAT", max: 4, right: true},
		{head: "AGE", max: 6, right: true},
		{head: "LAST FAILURE"},
	}}
	// why are the failures of breakers that are not closed, for a note
	// with the whole reason when the table cuts it.
	type reason struct{ key, text string }
	var why []reason
	var notes []string
	withWhy := func(key string, st BreakerState) string {
		cell := failureCell(st, o.Now)
		if st.State != "closed" && cell != "" {
			why = append(why, reason{key, cell})
		}
		return cell
	}
	for _, a := range addrs {
		r := rows[a]
		state, failure := "-", ""
		if r.own != nil {
			state, failure = breakerCell(r.own.BreakerState, o.Now), withWhy(r.addr, r.own.BreakerState)
			notes = appendOpener(notes, *r.own)
		} else if len(r.models) > 0 {
			state = ""
		}
		score, age := "-", "-"
		if r.sat != nil {
			score, age = "?", "none"
			if r.sat.ScoreKnown {
				score = strconv.FormatFloat(r.sat.Score, 'f', 2, 64)
			}
			if r.sat.AgeSeconds >= 0 {
				age = duration(time.Duration(r.sat.AgeSeconds * float64(time.Second)))
			}
			if r.sat.LastError != "" {
				notes = append(notes, fmt.Sprintf("scrape of %s failed: %s", r.addr, clean(r.sat.LastError)))
			}
		}
		t.add(clean(r.addr), state, strconv.FormatInt(r.inflight, 10), score, age, failure)
		for _, m := range r.models {
			label := m.Model
			switch {
			case m.Handler != "" && (len(handlers[a]) > 1 || m.Model == ""):
				label = strings.TrimSuffix(m.Handler+" "+m.Model, " ")
			case m.Handler == "" && m.Policy != "":
				label = strings.TrimSuffix("~"+m.Policy+" "+m.Model, " ") // a gateway of an earlier version
			}
			t.add("  "+clean(label), breakerCell(m.BreakerState, o.Now), "", "", "", withWhy(clean(label), m.BreakerState))
			notes = appendOpener(notes, m)
		}
	}
	notes = append(notes, siteNotes(s.Breakers)...)
	notes = append(notes, poolNotes(s.Pools, o.Now)...)
	w := t.write(b, o.Width)
	var cutWhy []string
	for _, y := range why {
		if runes(y.text) > w[len(w)-1] {
			cutWhy = append(cutWhy, clean(y.key)+": "+y.text)
		}
	}
	if len(s.Saturation) > 0 {
		notes = append(notes, "SAT: saturation score (1 saturated, ? unknown), AGE: its scrape's age")
	}
	for _, n := range append(cutWhy, notes...) {
		b.WriteString(cut("  "+n, o.Width, false) + "\n")
	}
}

// siteNotes names the handlers (sites) each breaker serves: one note per
// set of handlers, "breakers of <handlers>: <keys>", in the order of the
// breakers' keys; a breaker the gateway lists no handlers for is named by
// its pools (a gateway from before handler names), and one with neither
// is left out.
func siteNotes(brs []Breaker) []string {
	sorted := slices.Clone(brs)
	slices.SortFunc(sorted, func(a, b Breaker) int { return strings.Compare(a.Key, b.Key) })
	var order []string
	keys := map[string][]string{}
	for _, br := range sorted {
		names := br.Handlers
		if len(names) == 0 {
			names = br.Pools
		}
		if len(names) == 0 {
			continue
		}
		cleaned := make([]string, len(names))
		for i, n := range names {
			cleaned[i] = clean(n)
		}
		set := strings.Join(cleaned, "; ")
		if _, ok := keys[set]; !ok {
			order = append(order, set)
		}
		keys[set] = append(keys[set], clean(br.Key))
	}
	notes := make([]string, 0, len(order))
	for _, set := range order {
		notes = append(notes, fmt.Sprintf("breakers of %s: %s", set, strings.Join(keys[set], ", ")))
	}
	return notes
}

// appendOpener adds a note naming the instance that opened br fleet-wide.
func appendOpener(notes []string, br Breaker) []string {
	if br.OpenedBy == "" {
		return notes
	}
	return append(notes, fmt.Sprintf("%s opened fleet-wide by %s", clean(br.Key), clean(br.OpenedBy)))
}

// tenants writes one row per tenant with state.
func tenants(b *strings.Builder, s Status, o Options) {
	fmt.Fprintf(b, "TENANTS (%d)\n", len(s.Tenants))
	if len(s.Tenants) == 0 {
		b.WriteString("  none with state: no tenants configured, or no requests yet\n")
		return
	}
	t := table{cols: []column{
		{head: "TENANT", max: 16},
		{head: "TIER", max: 12},
		{head: "INFL", max: 7, right: true},
		{head: "QUEUED", max: 6, right: true},
		{head: "REQ/MIN", max: 9, right: true},
		{head: "TOK/MIN", max: 11, right: true},
		{head: "BREAKER"},
	}}
	for _, tn := range s.Tenants {
		state := "-"
		if tn.Breaker != nil {
			state = breakerCell(*tn.Breaker, o.Now)
		}
		t.add(clean(tn.Tenant), clean(tn.Tier),
			ofLimit(strconv.Itoa(tn.Inflight), tn.MaxConcurrent, strconv.Itoa),
			strconv.Itoa(tn.Queued),
			ofLimit(count(tn.RequestsInWindow), tn.RPM, count),
			ofLimit(count(tn.TokensInWindow), tn.TPM, count),
			state)
	}
	t.write(b, o.Width)
}

// fleetState writes the fleet's mode and the instances seen recently.
func fleetState(b *strings.Builder, f Fleet, o Options) {
	since := ""
	if f.Since != nil && !f.Since.IsZero() {
		since = fmt.Sprintf(" since %s (%s ago)", f.Since.UTC().Format("15:04:05 UTC"), duration(o.Now.Sub(*f.Since)))
	}
	id := ""
	if f.InstanceID != "" {
		id = ", instance " + clean(f.InstanceID)
	}
	var line string
	switch f.Mode {
	case "off", "":
		line = "FLEET off: no fleet configured; breakers and limits are this gateway's own"
	case "local":
		line = "FLEET local" + since + id + "\n  Redis away: breakers and limits run on this gateway's own state"
	default:
		line = "FLEET " + clean(f.Mode) + since + id
	}
	for l := range strings.SplitSeq(line, "\n") {
		b.WriteString(cut(l, o.Width, false) + "\n")
	}
	if f.Error != "" {
		b.WriteString(cut("  listing instances failed: "+clean(f.Error), o.Width, false) + "\n")
	}
	if f.Mode != "fleet" {
		return
	}
	if len(f.Instances) == 0 {
		b.WriteString("  no instances seen\n")
		return
	}
	t := table{cols: []column{{head: "INSTANCE", max: 40}, {head: "LAST SEEN"}}}
	for _, in := range f.Instances {
		t.add(clean(in.ID), duration(o.Now.Sub(in.LastSeen))+" ago")
	}
	t.write(b, o.Width)
}

// breakerCell is a breaker's state and time in it ("open 41s"), marked
// "forced" when an operator opened it and "sat" when a saturation signal
// did; a closed breaker is just "closed".
func breakerCell(st BreakerState, now time.Time) string {
	s := clean(st.State)
	if s == "" {
		return "-"
	}
	if s == "closed" {
		return s
	}
	if !st.Since.IsZero() {
		s += " " + duration(now.Sub(st.Since))
	}
	if st.Forced {
		s += " forced"
	} else if st.Observed {
		s += " sat"
	}
	if st.ProbeDue {
		s += " due"
	}
	return s
}

// poolNotes says, for each pool that is not plainly serving, what holds
// it: failed as a whole, in panic, or upstreams ejected.
func poolNotes(ps []Pool, now time.Time) []string {
	var out []string
	for _, p := range ps {
		name := clean(p.Handler)
		if name == "" {
			name = clean(p.Key)
		}
		switch {
		case p.Failed:
			n := fmt.Sprintf("pool %s failed as a whole", name)
			if !p.FailedSince.IsZero() {
				n += " " + duration(now.Sub(p.FailedSince)) + " ago"
			}
			if p.FailedReason != "" {
				n += " (" + clean(p.FailedReason) + ")"
			}
			out = append(out, n+": 503 but for probes")
		case p.Panic:
			out = append(out, fmt.Sprintf("pool %s in panic: routes over its %d ejected upstream(s)", name, p.Ejected))
		case p.Ejected > 0:
			out = append(out, fmt.Sprintf("pool %s: %d of at most %d upstream(s) ejected", name, p.Ejected, p.MaxEjected))
		}
	}
	return out
}

// failureCell is the last failure's age and reason ("12s ago: http 502"),
// "" when none was recorded.
func failureCell(st BreakerState, now time.Time) string {
	if st.LastFailureAt.IsZero() && st.LastFailure == "" {
		return ""
	}
	s := ""
	if !st.LastFailureAt.IsZero() {
		s = duration(now.Sub(st.LastFailureAt)) + " ago"
	}
	if st.LastFailure != "" {
		if s != "" {
			s += ": "
		}
		s += clean(st.LastFailure)
	}
	return s
}

// ofLimit is "n/limit", or n alone without a limit (0).
func ofLimit(n string, limit int, format func(int) string) string {
	if limit <= 0 {
		return n
	}
	return n + "/" + format(limit)
}

// count is n in at most 5 runes with an SI prefix (950, 1.2k, 120k, 3.4M).
func count(n int) string {
	if n < 1000 {
		return strconv.Itoa(n)
	}
	v, prefix := humanize.ComputeSI(float64(n))
	digits := 1
	if v >= 10 {
		digits = 0
	}
	return strconv.FormatFloat(v, 'f', digits, 64) + prefix
}

// duration is d in at most 7 runes: "0.4s" and "9.9s" below 10s, then
// "41s", "2m05s", "3h07m", "2d05h". A negative d (clock skew) is 0.
func duration(d time.Duration) string {
	d = max(d, 0)
	switch {
	case d < 10*time.Second:
		return strconv.FormatFloat(d.Seconds(), 'f', 1, 64) + "s"
	case d < time.Minute:
		return strconv.Itoa(int(d/time.Second)) + "s"
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", d/time.Minute, d%time.Minute/time.Second)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", d/time.Hour, d%time.Hour/time.Minute)
	default:
		return fmt.Sprintf("%dd%02dh", d/(24*time.Hour), d%(24*time.Hour)/time.Hour)
	}
}
