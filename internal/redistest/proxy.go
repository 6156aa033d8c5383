package redistest

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Mode is what a Proxy does with the bytes it carries.
type Mode int32

const (
	// Pass forwards both ways at once.
	Pass Mode = iota
	// Slow holds each chunk of replies (server to client) for the
	// proxy's latency before forwarding it; commands pass at once.
	Slow
	// Blackhole accepts connections and forwards nothing either way: the
	// server never sees a command, the client never gets a reply, nothing
	// is closed. A network partition, or a server frozen mid-failover.
	Blackhole
	// Mute forwards commands but drops the replies: the server applies a
	// command that the client never hears about (an ambiguous failure: a
	// timeout after sending).
	Mute
	// Reset closes every connection with a TCP RST, and each new one as
	// soon as it is accepted.
	Reset
)

func (m Mode) String() string {
	switch m {
	case Pass:
		return "pass"
	case Slow:
		return "slow"
	case Blackhole:
		return "blackhole"
	case Mute:
		return "mute"
	case Reset:
		return "reset"
	}
	return "unknown"
}

// Proxy is a TCP proxy on a loopback port in front of a server, whose mode
// switches at run time. Safe for concurrent use.
type Proxy struct {
	ln      net.Listener
	target  atomic.Pointer[string]
	mode    atomic.Int32
	latency atomic.Int64 // nanoseconds, for Slow
	accepts atomic.Int64

	mu     sync.Mutex
	links  map[*link]struct{}
	closed bool
	wg     sync.WaitGroup
}

// link is one proxied connection.
type link struct {
	client, server net.Conn
	once           sync.Once
}

// NewProxy starts a proxy in Pass mode that forwards each new connection to
// target (host:port), and closes it when the test ends.
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("redistest: proxy listen: %v", err)
	}
	p := &Proxy{ln: ln, links: make(map[*link]struct{})}
	p.target.Store(&target)
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.Close)
	return p
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Mode returns the current mode.
func (p *Proxy) Mode() Mode { return Mode(p.mode.Load()) }

// Accepted is the number of connections accepted so far.
func (p *Proxy) Accepted() int64 { return p.accepts.Load() }

// Pass forwards everything at once from now on.
func (p *Proxy) Pass() { p.mode.Store(int32(Pass)) }

// Latency holds every chunk of replies for d from now on (Slow).
func (p *Proxy) Latency(d time.Duration) {
	p.latency.Store(int64(d))
	p.mode.Store(int32(Slow))
}

// Blackhole stops forwarding either way, on existing connections and new
// ones, without closing any.
func (p *Proxy) Blackhole() { p.mode.Store(int32(Blackhole)) }

// Mute forwards commands but drops every reply from now on.
func (p *Proxy) Mute() { p.mode.Store(int32(Mute)) }

// Reset closes every existing connection with an RST and, until the mode
// changes, each new one as it is accepted.
func (p *Proxy) Reset() {
	p.mode.Store(int32(Reset))
	p.mu.Lock()
	links := make([]*link, 0, len(p.links))
	for l := range p.links {
		links = append(links, l)
	}
	p.mu.Unlock()
	for _, l := range links {
		p.drop(l)
	}
}

// SetTarget sends new connections to addr; existing ones keep theirs (a
// failover behind a stable name).
func (p *Proxy) SetTarget(addr string) { p.target.Store(&addr) }

// Close stops accepting, closes every connection and waits for the
// proxy's goroutines.
func (p *Proxy) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	links := make([]*link, 0, len(p.links))
	for l := range p.links {
		links = append(links, l)
	}
	p.mu.Unlock()
	_ = p.ln.Close()
	for _, l := range links {
		p.drop(l)
	}
	p.wg.Wait()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.accepts.Add(1)
		if p.Mode() == Reset {
			rst(c)
			continue
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

func (p *Proxy) serve(c net.Conn) {
	defer p.wg.Done()
	s, err := net.DialTimeout("tcp", *p.target.Load(), time.Second)
	if err != nil {
		rst(c)
		return
	}
	l := &link{client: c, server: s}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		p.drop(l)
		return
	}
	p.links[l] = struct{}{}
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		p.pump(l, s, c, false)
	}()
	p.pump(l, c, s, true)
}

// pump copies from src to dst as the mode says until either side fails,
// then drops the link. reply is the server-to-client direction.
func (p *Proxy) pump(l *link, dst, src net.Conn, reply bool) {
	defer p.drop(l)
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			switch p.Mode() {
			case Blackhole:
				n = 0
			case Mute:
				if reply {
					n = 0
				}
			case Slow:
				if reply {
					time.Sleep(time.Duration(p.latency.Load()))
				}
			case Reset:
				return
			}
			if n > 0 {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// drop closes both sides of a link, the client's with an RST, once.
func (p *Proxy) drop(l *link) {
	l.once.Do(func() {
		rst(l.client)
		_ = l.server.Close()
		p.mu.Lock()
		delete(p.links, l)
		p.mu.Unlock()
	})
}

// rst closes c so that the peer gets a reset rather than an orderly end.
func rst(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}
