//go:build unix

package h1

import (
	"errors"
	"io"
	"net"
	"syscall"
)

// alive reports whether an idle connection is still open and quiet: a
// non-blocking peek finds neither the server's close (a read of 0) nor
// bytes nobody asked for. A connection that cannot be peeked at (not a
// socket) is taken as alive.
func alive(nc net.Conn) bool {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return true
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	var buf [1]byte

	var rerr error
	err = rc.Read(func(fd uintptr) bool {
		_, _, rerr = syscall.Recvfrom(int(fd), buf[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		return true // never wait for readability
	})
	if err != nil {
		return false
	}
	if errors.Is(rerr, syscall.EAGAIN) || errors.Is(rerr, syscall.EWOULDBLOCK) {
		return true
	}
	// n == 0 with no error is the server's FIN; n > 0 is an unasked-for
	// answer (a 408 before closing); any other error is a dead socket.
	return false
}

// answered reports whether a server that stopped reading a request body
// has answered it or closed: a non-blocking peek finds the close, an error,
// or bytes other than interim (1xx) heads. Heads cut short by the peek's
// window or still arriving are not yet an answer.
func answered(nc net.Conn) bool {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return true
	}
	buf := make([]byte, 4<<10) // only once a write stalled
	n := 0
	var rerr error
	err = rc.Read(func(fd uintptr) bool {
		n, _, rerr = syscall.Recvfrom(int(fd), buf, syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		return true
	})
	switch {
	case err != nil:
		return true
	case errors.Is(rerr, syscall.EAGAIN) || errors.Is(rerr, syscall.EWOULDBLOCK):
		return false
	case rerr != nil || n <= 0:
		return true
	}
	return !interimOnly(buf[:n])
}

// rawConn returns the raw socket of a plain TCP or Unix connection, the
// only ones a body reads from directly: a wrapper (Caddy's read and write
// timeouts) sets deadlines in its Read that a raw read would skip.
func rawConn(nc net.Conn) syscall.RawConn {
	var sc syscall.Conn
	switch c := nc.(type) {
	case *net.TCPConn:
		sc = c
	case *net.UnixConn:
		sc = c
	default:
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

// waitRead reads into b's buffer once the socket has bytes, holding the
// buffer only while a read can succeed: a read that would block gives it
// back before the goroutine parks. It reports false when the connection
// cannot be read this way (then nothing was done).
func (b *body) waitRead() (bool, error) {
	if b.rc == nil {
		if b.rc = rawConn(b.c.nc); b.rc == nil {
			return false, nil
		}
		b.readFn = b.rawRead
	}
	b.rerr = nil
	if err := b.rc.Read(b.readFn); err != nil {
		return true, err
	}
	return true, b.rerr
}

// rawRead is the RawConn read function of waitRead: it reports true (done)
// when the read returned bytes, the end (io.EOF) or an error.
func (b *body) rawRead(fd uintptr) bool {
	if b.buf == nil {
		b.takeBuf()
	}
	n, err := syscall.Read(int(fd), b.buf[b.w:])
	switch {
	case errors.Is(err, syscall.EAGAIN):
		b.dropBuf()
		return false
	case err != nil:
		b.rerr = err
	case n == 0:
		b.rerr = io.EOF
	default:
		b.w += n
	}
	return true
}
