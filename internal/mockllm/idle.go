package mockllm

import (
	"io"
	"net"
	"sync"
	"time"
)

// idleRaceListener wraps a replica's listener so that its connections
// emulate the race of FleetConfig.IdleCloseRace: a request whose first
// bytes arrive on a keep-alive connection that has been idle (no response
// byte written) for at least threshold is dropped, its connection closed
// before any response byte, as if the server's idle close had crossed the
// request on the wire.
type idleRaceListener struct {
	net.Listener
	r         *Replica
	threshold time.Duration
}

func (l *idleRaceListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &idleRaceConn{Conn: c, l: l}, nil
}

// idleRaceConn is one connection of an idleRaceListener.
type idleRaceConn struct {
	net.Conn
	l *idleRaceListener

	mu sync.Mutex
	// armed is set by every write (a response byte) and cleared by the
	// first read after it: that read carries the next request's first
	// bytes, the moment the connection's idle time is judged.
	armed     bool
	lastWrite time.Time
	dropped   bool
}

func (c *idleRaceConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if n > 0 {
		c.mu.Lock()
		c.armed, c.lastWrite = true, time.Now()
		c.mu.Unlock()
	}
	return n, err
}

func (c *idleRaceConn) Read(p []byte) (int, error) {
	c.mu.Lock()
	dropped := c.dropped
	c.mu.Unlock()
	if dropped {
		return 0, io.EOF
	}
	n, err := c.Conn.Read(p)
	if n == 0 {
		return n, err
	}
	c.mu.Lock()
	drop := c.armed && time.Since(c.lastWrite) >= c.l.threshold
	c.armed = false
	c.dropped = c.dropped || drop
	c.mu.Unlock()
	if !drop {
		return n, err
	}
	// The request's bytes are discarded unanswered: to net/http the
	// connection ended (io.EOF is closed quietly), to the client it closes
	// right after its request was sent.
	c.l.r.mu.Lock()
	c.l.r.stats.idleDrops++
	c.l.r.mu.Unlock()
	c.Conn.Close()
	return 0, io.EOF
}
