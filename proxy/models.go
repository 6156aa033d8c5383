package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
	"golang.org/x/sync/singleflight"
)

// Defaults of Models.
const (
	// DefaultModelsTTL is how long a merged model list is served before
	// the pools are asked again.
	DefaultModelsTTL = 30 * time.Second
	// DefaultModelsTimeout bounds one upstream's /v1/models answer.
	DefaultModelsTimeout = 5 * time.Second
	// maxModelsBody bounds one upstream's /v1/models body.
	maxModelsBody = 4 << 20
)

// ModelSource is a pool whose upstreams are asked for the models they serve.
type ModelSource struct {
	// Name attributes the pool's entries: "primary", or a fallback's name.
	Name string
	// Balancer picks the upstream to ask (breakers respected).
	Balancer Balancer
	// Header, when set, edits the header of the request to the pool (its
	// Headers.Request: header_up, the pool's credentials), as for a
	// completion; r is the caller's request. Default: none.
	Header func(r *http.Request, h http.Header)
}

// Models answers GET /v1/models with the union of the models that a
// handler's pools serve, so that SDKs listing models see every route: each
// pool is asked through one of its upstreams (another if that one fails),
// the lists are merged by model id in pool order, and each entry gains
// "pools", the names of the pools that serve it. The merged list is cached
// for TTL. A pool that cannot be asked (no upstream with a closed breaker,
// or none answering) is listed with its last answer; when no pool ever
// answered, the client gets 502. Safe for concurrent use.
//
// One refresh runs at a time, whoever asks: the callers that arrive while
// it runs wait for its list (each may leave when its own request ends,
// which never cancels the refresh). The refresh runs under a context of
// its own — the first caller's values (Caddy's replacer, for dynamic
// upstream sources) without its cancellation — and each upstream's answer
// is bounded by Timeout. It asks only upstreams whose breaker is closed,
// so it never takes a recovering breaker's probe.
type Models struct {
	// Sources are the pools, primary first.
	Sources []ModelSource
	// Transport performs the requests (the handler's). Required.
	Transport http.RoundTripper
	// TTL is how long a merged list is served; default DefaultModelsTTL.
	TTL time.Duration
	// Timeout bounds each upstream's answer; default DefaultModelsTimeout.
	Timeout time.Duration
	// Clock is the source of time; nil is the real clock.
	Clock clock.Clock
	// Cache holds the merged list and each source's last answer; nil
	// keeps them in m. Handlers over the same Sources (a reload's old and
	// new config) share one (see ModelsKey), so a reload neither asks the
	// pools again within TTL nor forgets a pool that cannot answer now.
	Cache *ModelCache

	own ModelCache
}

// ModelCache is what Models remembers between requests: the merged list
// and when it was made, and each source's last answer. The zero value is
// empty and ready. Safe for concurrent use.
type ModelCache struct {
	// flight runs one refresh at a time.
	flight singleflight.Group
	mu     sync.Mutex // guards body and at
	body   []byte
	at     time.Time
	// answers holds each source's last list, by index in Sources; only
	// the running refresh reads or writes it.
	answers [][]json.RawMessage
}

// ModelsKey identifies srcs for a shared ModelCache: each source's name
// and, for a Balancer with a Key method (an upstream pool's identity),
// its key, in order.
func ModelsKey(srcs []ModelSource) string {
	var b strings.Builder
	for _, s := range srcs {
		b.WriteString(s.Name)
		b.WriteByte('\x00')
		if k, ok := s.Balancer.(interface{ Key() string }); ok {
			b.WriteString(k.Key())
		}
		b.WriteByte('\n')
	}
	return b.String()
}

func (m *Models) cache() *ModelCache {
	if m.Cache != nil {
		return m.Cache
	}
	return &m.own
}

// IsModelsRequest reports whether r asks for the model list (GET …/v1/models).
func IsModelsRequest(r *http.Request) bool {
	p := r.URL.Path
	return r.Method == http.MethodGet && len(p) >= len("/v1/models") && p[len(p)-len("/v1/models"):] == "/v1/models"
}

// ServeHTTP writes the merged model list to a client that id lets in
// (nil: everyone): the same credentials as for completions, so an unknown
// key gets the same 401.
func (m *Models) ServeHTTP(w http.ResponseWriter, r *http.Request, id Identifier) {
	if id != nil {
		if _, err := id.Identify(r, RequestInfo{}); err != nil {
			ge, ok := errors.AsType[*GatewayError](err)
			if !ok {
				ge = &GatewayError{Status: http.StatusInternalServerError, Type: TypeServer, Code: "internal_error",
					Message: "the gateway could not identify the request"}
			}
			ge.Write(w)
			return
		}
	}
	body, err := m.list(r)
	if err != nil && r.Context().Err() != nil {
		return // the client left while the list was refreshed
	}
	if err != nil {
		(&GatewayError{Status: http.StatusBadGateway, Type: TypeServer, Code: "upstream_error",
			Message: "no pool listed its models: " + err.Error()}).Write(w)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(body)
}

func (m *Models) clock() clock.Clock { return clock.Or(m.Clock) }

// list returns the cached list, or a fresh one when it is older than TTL;
// it returns r's context error if r ends while the refresh runs.
func (m *Models) list(r *http.Request) ([]byte, error) {
	ttl := m.TTL
	if ttl <= 0 {
		ttl = DefaultModelsTTL
	}
	c := m.cache()
	c.mu.Lock()
	body, at := c.body, c.at
	c.mu.Unlock()
	if body != nil && m.clock().Now().Sub(at) < ttl {
		return body, nil
	}
	ch := c.flight.DoChan("list", func() (any, error) { return m.refresh(r, c) })
	select {
	case res := <-ch:
		if res.Err != nil {
			return nil, res.Err
		}
		return res.Val.([]byte), nil
	case <-r.Context().Done():
		return nil, r.Context().Err()
	}
}

// refresh asks the pools under a context of its own (r's values, not its
// cancellation) and caches the merged list; when no pool answers it
// returns the last list, if any.
func (m *Models) refresh(r *http.Request, c *ModelCache) ([]byte, error) {
	r = r.WithContext(context.WithoutCancel(r.Context()))
	body, err := m.merge(r, c)
	c.mu.Lock()
	defer c.mu.Unlock()
	if err != nil {
		if c.body != nil {
			return c.body, nil
		}
		return nil, err
	}
	c.body, c.at = body, m.clock().Now()
	return body, nil
}

// merge asks every pool and merges their lists, remembering each
// pool's answer in c.
func (m *Models) merge(r *http.Request, c *ModelCache) ([]byte, error) {
	type entry struct {
		raw   []byte
		pools []string
	}
	var order []string
	byID := map[string]*entry{}
	var lastErr error
	answered := 0
	if len(c.answers) != len(m.Sources) {
		c.answers = make([][]json.RawMessage, len(m.Sources))
	}
	for i, src := range m.Sources {
		data, err := m.ask(r, src)
		switch {
		case err == nil:
			c.answers[i] = data
		case c.answers[i] != nil:
			// A pool that cannot be asked now (its breakers open, its
			// upstreams down) still serves its models through the
			// ladder: its last list stands, or SDKs listing models see
			// a route vanish and come back with its breakers.
			data = c.answers[i]
		default:
			lastErr = fmt.Errorf("%s: %w", src.Name, err)
			continue
		}
		answered++
		for _, item := range data {
			id := gjson.GetBytes(item, "id").String()
			if id == "" {
				continue
			}
			e := byID[id]
			if e == nil {
				e = &entry{raw: item}
				byID[id] = e
				order = append(order, id)
			}
			e.pools = append(e.pools, src.Name)
		}
	}
	if answered == 0 {
		if lastErr == nil {
			lastErr = ErrNoUpstream
		}
		return nil, lastErr
	}
	out := []byte(`{"object":"list","data":[]}`)
	for i, id := range order {
		e := byID[id]
		item, err := sjson.SetBytes(e.raw, "pools", e.pools)
		if err != nil {
			continue
		}
		if out, err = sjson.SetRawBytes(out, "data."+strconv.Itoa(i), item); err != nil {
			return nil, err
		}
	}
	return append(out, '\n'), nil
}

// ask returns the "data" entries of one pool's /v1/models, trying a second
// upstream when the first fails.
func (m *Models) ask(r *http.Request, src ModelSource) ([]json.RawMessage, error) {
	timeout := m.Timeout
	if timeout <= 0 {
		timeout = DefaultModelsTimeout
	}
	var tried []string
	var lastErr error
	for range 2 {
		// Closed breakers only (as a hedge asks): a half-open breaker's
		// probe slot is for requests that tell whether it recovered.
		up, err := src.Balancer.Pick(nowhereWriter{}, r, PickRequest{Tried: tried, Hedge: true})
		if err != nil {
			if lastErr == nil {
				lastErr = err
			}
			break
		}
		tried = append(tried, up.Addr)
		data, err := m.fetch(r, src, up, timeout)
		release(up)
		if err == nil {
			return data, nil
		}
		lastErr = err
	}
	return nil, lastErr
}

func (m *Models) fetch(r *http.Request, src ModelSource, up Upstream, timeout time.Duration) ([]json.RawMessage, error) {
	ctx, cancel := context.WithTimeout(r.Context(), timeout)
	defer cancel()
	if up.Context != nil {
		ctx = up.Context(ctx)
	}
	// A request of the gateway's own: no client header (keys) goes along,
	// only the pool's header_up.
	out, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+up.Addr+"/v1/models", nil)
	if err != nil {
		return nil, err
	}
	out.URL.Scheme = "" // the transport sets its own (https for TLS upstreams)
	out.Header.Set("Accept", "application/json")
	if src.Header != nil {
		// As for a completion: Host in the header on entry, the last
		// value left there the request's.
		out.Header["Host"] = []string{out.Host}
		src.Header(r, out.Header)
		out.Host = ""
		if vs := out.Header["Host"]; len(vs) > 0 {
			out.Host = vs[len(vs)-1]
		}
		delete(out.Header, "Host")
	}
	resp, err := m.Transport.RoundTrip(out)
	if err != nil {
		return nil, fmt.Errorf("upstream %s: %w", up.Addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("upstream %s: status %d", up.Addr, resp.StatusCode)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxModelsBody))
	if err != nil {
		return nil, fmt.Errorf("upstream %s: %w", up.Addr, err)
	}
	var list struct {
		Data []json.RawMessage `json:"data"`
	}
	if err := json.Unmarshal(b, &list); err != nil {
		return nil, fmt.Errorf("upstream %s: not a model list: %w", up.Addr, err)
	}
	return list.Data, nil
}

// nowhereWriter is the writer a Balancer gets for the gateway's own
// requests: a cookie a policy sets goes nowhere.
type nowhereWriter struct{}

func (nowhereWriter) Header() http.Header         { return http.Header{} }
func (nowhereWriter) Write(b []byte) (int, error) { return len(b), nil }
func (nowhereWriter) WriteHeader(int)             {}
