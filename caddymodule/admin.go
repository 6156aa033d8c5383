package caddymodule

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/fleet"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves the breakers on Caddy's admin endpoint:
//
//	GET  /llm_proxy/breakers                   every breaker, as JSON, with "scope":
//	                                           "fleet" (shared through the fleet) or
//	                                           "local", and "opened_by" (the instance
//	                                           that opened it fleet-wide)
//	GET  /llm_proxy/breakers/<key>             one breaker
//	POST /llm_proxy/breakers/<key>/open[?for=<duration>]   force open (until close without for)
//	POST /llm_proxy/breakers/<key>/close       force closed
//	POST /llm_proxy/breakers/<key>/reset       fresh closed state
//
// <key> is a breaker's key: the upstream's dial address ("10.0.0.2:8000"),
// then "|<model>" under scope model, which names every handler's breaker
// of it; or a breaker's fleet_key ("10.0.0.2:8000~<policy>[|<model>]"),
// which names the breakers of the handlers with that policy. Escape it in
// the path as needed. A GET shows the first handler's breaker the key
// names. A POST to a plain dial address acts on the upstream: every
// breaker of it (every handler's, every model), and open drains it — a
// breaker created while the drain lasts starts open too — so that no site
// sends there; a POST to another key acts on the breakers it names. A
// POST answers with the list of the breakers it changed. And
// the tenants:
//
//	GET  /llm_proxy/tenants                    every tenant with state: tier, in-flight,
//	                                           queued, usage in the window, limits, breaker
//	GET  /llm_proxy/tenants/<id>               one tenant
//	POST /llm_proxy/tenants/<id>/open[?for=<duration>]|close|reset   its tenant breaker
//
// And the upstreams' saturation, read from their /metrics (handlers with
// saturation configured):
//
//	GET  /llm_proxy/saturation                 every scraped upstream's snapshot: score,
//	                                           in-flight counts, each signal's last value
//	                                           and state, the scrape's age and error
//	GET  /llm_proxy/saturation/<upstream>      one upstream (its dial address)
//
// And the pools:
//
//	GET  /llm_proxy/pools                      every pool of the running config: "key",
//	                                           "handler" (Handler.Name), "max_ejection", "panic_threshold" (negative:
//	                                           off), "ejected" and "max_ejected" (upstreams
//	                                           held open on statistical evidence), "probation"
//	                                           (back from an ejection, still counted
//	                                           against max_ejected), "panic", "panic_requests"
//
// Each breaker's "evidence" ("hard" or "statistical"), "probe_failures",
// "peer_ratio", "pools" and "handlers" (the names of the handlers whose
// requests it governs, Handler.Name) are in /llm_proxy/breakers.
//
// And the fleet:
//
//	GET  /llm_proxy/fleet                      {"mode": "fleet"|"local"|"off", "instance_id",
//	                                           "since" (the last switch of mode), "instances":
//	                                           [{"instance_id", "last_seen"}] seen in the last
//	                                           3 × refresh (empty in local mode)}
//
// No key appears anywhere.
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.llm_proxy",
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes returns the admin routes.
func (a adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{
		{Pattern: "/llm_proxy/breakers", Handler: caddy.AdminHandlerFunc(a.list)},
		{Pattern: "/llm_proxy/breakers/", Handler: caddy.AdminHandlerFunc(a.control)},
		{Pattern: "/llm_proxy/tenants", Handler: caddy.AdminHandlerFunc(a.tenants)},
		{Pattern: "/llm_proxy/tenants/", Handler: caddy.AdminHandlerFunc(a.tenant)},
		{Pattern: "/llm_proxy/saturation", Handler: caddy.AdminHandlerFunc(a.saturation)},
		{Pattern: "/llm_proxy/saturation/", Handler: caddy.AdminHandlerFunc(a.saturation)},
		{Pattern: "/llm_proxy/fleet", Handler: caddy.AdminHandlerFunc(a.fleet)},
		{Pattern: "/llm_proxy/pools", Handler: caddy.AdminHandlerFunc(a.pools)},
	}
}

// pools serves the running config's pools: their ejection cap and panic
// rule, how many upstreams are held open on statistical evidence, and
// whether the pool is in panic mode.
func (adminAPI) pools(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	views := []upstream.PoolStatus{}
	if c := shared.live.Newest(); c != nil {
		for _, p := range c.Pools {
			views = append(views, p.Status())
		}
	}
	return writeJSON(w, views)
}

// fleet serves this instance's fleet mode and the instances seen recently.
func (adminAPI) fleet(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	c := liveFleet()
	v := fleetView{Mode: fleetMode(c), Instances: []fleet.Instance{}}
	if c != nil {
		v.InstanceID = c.InstanceID()
		since := c.Since().UTC()
		v.Since = &since
		if !c.Degraded() {
			list, err := c.Instances(r.Context())
			if err != nil {
				v.Error = err.Error()
			} else {
				v.Instances = list
			}
			v.Mode = fleetMode(c) // the listing may have been the failure that switched it
		}
	}
	return writeJSON(w, v)
}

// saturation serves the upstreams' saturation snapshots, every one or the
// one named after the slash, with their age now.
func (adminAPI) saturation(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	views := shared.upstreams.Saturation(time.Now())
	addr, one := strings.CutPrefix(r.URL.Path, "/llm_proxy/saturation/")
	if !one {
		if views == nil {
			views = []saturation.View{}
		}
		return writeJSON(w, views)
	}
	for _, v := range views {
		if v.Upstream == addr {
			return writeJSON(w, v)
		}
	}
	return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no saturation snapshot for upstream %q (not scraped yet, or no handler with saturation uses it)", addr)}
}

func (adminAPI) list(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	views := shared.upstreams.Breakers()
	if views == nil {
		views = []upstream.BreakerView{}
	}
	st := liveBreakerStore()
	for i := range views {
		withScope(&views[i], st)
		for j, k := range views[i].Pools {
			views[i].Pools[j] = poolLabel(k)
		}
		views[i].Pool = poolLabel(views[i].Pool)
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(views)
}

// liveController is the tenant controller while a config with tenants
// holds it, nil otherwise.
func liveController() *admission.Controller {
	ctl, _ := shared.tenants.Peek("")
	return ctl
}

func writeJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(v)
}

func (adminAPI) tenants(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	views := []admission.TenantView{}
	if ctl := liveController(); ctl != nil {
		if v := ctl.Tenants(); v != nil {
			views = fleetTenantViews(v)
		}
	}
	return writeJSON(w, views)
}

func (adminAPI) tenant(w http.ResponseWriter, r *http.Request) error {
	rest := strings.TrimPrefix(r.URL.Path, "/llm_proxy/tenants/")
	ctl := liveController()
	find := func(id string) (admission.TenantView, bool) {
		if ctl == nil {
			return admission.TenantView{}, false
		}
		for _, v := range ctl.Tenants() {
			if v.Tenant == id {
				return fleetTenantViews([]admission.TenantView{v})[0], true
			}
		}
		return admission.TenantView{}, false
	}
	if r.Method == http.MethodGet {
		v, ok := find(rest)
		if !ok {
			return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no tenant %q with state", rest)}
		}
		return writeJSON(w, v)
	}
	if r.Method != http.MethodPost {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	i := strings.LastIndex(rest, "/")
	if i <= 0 {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("want /llm_proxy/tenants/<id>/open|close|reset")}
	}
	id, action := rest[:i], rest[i+1:]
	var b *breaker.Breaker
	if ctl != nil {
		b = ctl.TenantBreaker(id)
	}
	if b == nil {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("tenant %q has no breaker", id)}
	}
	if err := control(b, action, r); err != nil {
		return err
	}
	v, _ := find(id)
	return writeJSON(w, v)
}

// operatorAction is an operator's open, close or reset of a breaker, as
// the admin API parses it: open for d (0: until closed).
type operatorAction struct {
	name string
	d    time.Duration
}

const operatorReason = "by operator via admin API"

// parseAction reads an action ("open", "close", "reset") and, for open,
// the request's ?for=<duration>.
func parseAction(action string, r *http.Request) (operatorAction, error) {
	a := operatorAction{name: action}
	switch action {
	case "open":
		if s := r.URL.Query().Get("for"); s != "" {
			d, err := caddy.ParseDuration(s)
			if err != nil || d <= 0 {
				return a, caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: fmt.Errorf("bad duration %q", s)}
			}
			a.d = d
		}
	case "close", "reset":
	default:
		return a, caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("unknown action %q: want open, close or reset", action)}
	}
	return a, nil
}

// apply applies the action to one breaker.
func (a operatorAction) apply(b *breaker.Breaker) {
	switch a.name {
	case "open":
		b.ForceOpen(a.d, operatorReason)
	case "close":
		b.ForceClose(operatorReason)
	case "reset":
		b.Reset()
	}
}

// control applies an operator's open, close or reset to a breaker.
func control(b *breaker.Breaker, action string, r *http.Request) error {
	a, err := parseAction(action, r)
	if err != nil {
		return err
	}
	a.apply(b)
	return nil
}

// control serves one breaker (GET) and an operator's actions (POST
// <key>/open|close|reset). A plain dial address acts on the upstream:
// every breaker of every handler's policy and model (Entry.Drain and
// Undrain), so that an operator's drain keeps every site from sending
// there; "addr~policy" and "addr|model" keys act on that one breaker. The
// answer is the list of the breakers changed, sorted by key.
func (adminAPI) control(w http.ResponseWriter, r *http.Request) error {
	rest := strings.TrimPrefix(r.URL.Path, "/llm_proxy/breakers/")
	if r.Method == http.MethodGet {
		e, vs, ok := shared.upstreams.Find(rest)
		if !ok {
			if i := strings.LastIndex(rest, "/"); i > 0 && breakerExists(rest[:i]) {
				return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("use POST for %s", rest[i+1:])}
			}
			return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no breaker %q", rest)}
		}
		// Several handlers in front of the upstream: the first one's
		// (sorted by handler); the list shows them all.
		w.Header().Set("Content-Type", "application/json")
		return json.NewEncoder(w).Encode(view(e, vs[0]))
	}
	if r.Method != http.MethodPost {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
	}
	i := strings.LastIndex(rest, "/")
	if i <= 0 {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("want /llm_proxy/breakers/<key>/open|close|reset")}
	}
	key := rest[:i]
	a, err := parseAction(rest[i+1:], r)
	if err != nil {
		return err
	}
	var changed []*breaker.Breaker
	var e *upstream.Entry
	if ent, ok := shared.upstreams.Entry(key); ok {
		// The upstream: every breaker of it, now and while drained.
		e = ent
		var on bool
		if a.name == "open" {
			changed, on = e.Drain(a.d, operatorReason)
		} else {
			changed, on = e.Undrain(a.name == "reset", operatorReason)
		}
		if !on {
			return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("upstream %q has no breakers: every handler in front of it has breaker off", key)}
		}
	} else {
		var vs []upstream.Verdict
		var ok bool
		if e, vs, ok = shared.upstreams.Find(key); !ok {
			return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no breaker %q", key)}
		}
		for _, v := range vs {
			a.apply(v.Breaker) // every handler's breaker the key names
			changed = append(changed, v.Breaker)
		}
	}
	views := make([]upstream.BreakerView, 0, len(changed))
	for _, v := range e.Verdicts() {
		if slices.Contains(changed, v.Breaker) {
			views = append(views, view(e, v))
		}
	}
	return writeJSON(w, views)
}

// breakerExists reports whether key names a breaker or an upstream.
func breakerExists(key string) bool {
	if _, ok := shared.upstreams.Entry(key); ok {
		return true
	}
	_, _, ok := shared.upstreams.Find(key)
	return ok
}

// view is one handler's breaker as the admin API shows it.
func view(e *upstream.Entry, vd upstream.Verdict) upstream.BreakerView {
	v := e.View(vd)
	for j, k := range v.Pools {
		v.Pools[j] = poolLabel(k)
	}
	v.Pool = poolLabel(v.Pool)
	withScope(&v, liveBreakerStore())
	return v
}

// withScope says whether a breaker's state is the fleet's or its own, and
// which instance opened it fleet-wide: "fleet" with a fleet breaker store
// in fleet mode, unless it is open by its own rules alone (Local).
func withScope(v *upstream.BreakerView, st *fleet.Breakers) {
	v.Scope = "local"
	if st == nil {
		return
	}
	if !st.Degraded() && !v.Local {
		v.Scope = "fleet"
	}
	if open, ok := st.Opened(v.FleetKey); ok && v.State != breaker.Closed {
		v.OpenedBy = open.By
	}
}

var _ caddy.AdminRouter = adminAPI{}
