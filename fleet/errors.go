package fleet

import (
	"context"
	"errors"
	"net"
	"strings"

	"github.com/redis/go-redis/v9"
)

// ErrDegraded is what Do returns, at once and without touching Redis,
// while the client is in local mode.
var ErrDegraded = errors.New("fleet: local mode (redis unavailable)")

// ErrClosed is what Do returns after Close (a request still running on a
// config whose fleet settings were replaced).
var ErrClosed = errors.New("fleet: client closed")

// ErrorKind classifies a failed operation; it is the kind label of the
// errors metric. The empty kind is success (redis.Nil, a missing key,
// included).
type ErrorKind string

const (
	// KindTimeout: the operation ran out of OpTimeout (connecting, waiting
	// for a pooled connection, or waiting for the reply).
	KindTimeout ErrorKind = "timeout"
	// KindConn: the connection failed or Redis cannot serve: refused,
	// reset, closed, authentication refused, LOADING, MASTERDOWN, BUSY,
	// too many clients.
	KindConn ErrorKind = "conn"
	// KindReadonly: a replica answered a write (READONLY), as after a
	// Sentinel failover on a connection to the old master. The client
	// reconnects.
	KindReadonly ErrorKind = "readonly"
	// KindScript: a Lua script failed (NOSCRIPT, or an error raised while
	// it ran). Redis is up; the caller's script is at fault.
	KindScript ErrorKind = "script"
	// KindOther: any other error reply (WRONGTYPE, a bad argument). Redis
	// is up.
	KindOther ErrorKind = "other"
)

// unhealthy reports whether an error of kind k counts towards local mode:
// Redis is away, slow or cannot serve.
func (k ErrorKind) unhealthy() bool {
	return k == KindTimeout || k == KindConn || k == KindReadonly
}

// OpError is a failed operation, as Do returns it.
type OpError struct {
	Op   string    // the operation's name, as given to Do
	Kind ErrorKind // what failed
	Err  error     // go-redis's error
}

func (e *OpError) Error() string {
	return "fleet " + e.Op + ": " + string(e.Kind) + ": " + e.Err.Error()
}

func (e *OpError) Unwrap() error { return e.Err }

// KindOf returns the kind of an error from Do: "" for nil, redis.Nil and
// errors that did not come from Do.
func KindOf(err error) ErrorKind {
	var oe *OpError
	if errors.As(err, &oe) {
		return oe.Kind
	}
	return ""
}

// Ambiguous reports whether a failed operation may have been applied by
// Redis although the caller got an error: a timeout or a broken connection
// after the command may have been sent. Such an operation must never be
// replayed blindly — a second increment or reservation would double count.
// Make it idempotent (keyed by a request id) or let it go. Errors from
// local mode, refused dials and error replies were not applied.
func Ambiguous(err error) bool {
	var oe *OpError
	if !errors.As(err, &oe) {
		return false
	}
	switch oe.Kind {
	case KindTimeout:
		return !errors.Is(oe.Err, redis.ErrPoolTimeout) && !isDial(oe.Err)
	case KindConn:
		var re redis.Error
		return !errors.As(oe.Err, &re) && !isDial(oe.Err) && !errors.Is(oe.Err, redis.ErrClosed)
	}
	return false
}

func isDial(err error) bool {
	var oe *net.OpError
	return errors.As(err, &oe) && oe.Op == "dial"
}

// classify returns the kind of err ("" for success), and whether it is the
// caller's own cancellation or deadline, which says nothing about Redis.
func classify(caller context.Context, err error) (kind ErrorKind, callerDone bool) {
	if err == nil || errors.Is(err, redis.Nil) {
		return "", false
	}
	if caller.Err() != nil {
		return "", true
	}
	var re redis.Error
	if errors.As(err, &re) {
		return replyKind(re.Error()), false
	}
	var ne net.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, redis.ErrPoolTimeout),
		errors.As(err, &ne) && ne.Timeout():
		return KindTimeout, false
	}
	// Refused, reset, EOF, closed client, TLS handshake, unparsable
	// reply: no usable connection.
	return KindConn, false
}

// replyKind classifies a Redis error reply by its code.
func replyKind(msg string) ErrorKind {
	code, _, _ := strings.Cut(msg, " ")
	switch code {
	case "READONLY":
		return KindReadonly
	case "NOSCRIPT":
		return KindScript
	case "LOADING", "MASTERDOWN", "BUSY", "NOAUTH", "WRONGPASS", "CLUSTERDOWN", "TRYAGAIN", "NOREPLICAS":
		return KindConn
	case "ERR":
		switch {
		case strings.HasPrefix(msg, "ERR max number of clients"),
			strings.HasPrefix(msg, "ERR AUTH"), strings.Contains(msg, "invalid password"):
			return KindConn
		case strings.HasPrefix(msg, "ERR Error running script"), strings.HasPrefix(msg, "ERR user_script"),
			strings.Contains(msg, "script:"):
			return KindScript
		}
	}
	if strings.Contains(msg, "You can't write against a read only replica") {
		return KindReadonly
	}
	return KindOther
}
