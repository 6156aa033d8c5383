//go:build !unix

package h1

import (
	"net"
	"syscall"
)

// alive is true: without a non-blocking peek, a closed idle connection is
// found by the request written onto it.
func alive(net.Conn) bool { return true }

// answered is false: a stalled write waits for the server to read on, or
// for its context.
func answered(net.Conn) bool { return false }

// waitRead cannot read without a buffer here: the next Read waits, in one.
func (b *body) waitRead() (bool, error) { return false, nil }

// rawConn is nil: no connection is read or watched through its socket here.
func rawConn(net.Conn) syscall.RawConn { return nil }
