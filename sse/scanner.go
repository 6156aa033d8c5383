// Package sse is Server-Sent Events framing: a scanner that splits a stream
// into events whatever the reads' boundaries, the events' fields, and their
// kind (comment, data, the [DONE] marker, an in-band error). What an event
// means to a streaming API is package api's. The hot path (Next,
// Event.Kind) does not allocate in steady state.
package sse

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"sync"
)

// DefaultMaxEventSize is the event size limit used when NewScanner is given
// a non-positive maxEventSize: 1 MiB, far above any chat completion chunk but
// small enough that a misbehaving upstream cannot exhaust memory.
const DefaultMaxEventSize = 1 << 20

// ErrEventTooLarge is returned by Scanner.Next when an event (or a line that
// never ends) exceeds the scanner's maxEventSize. It is wrapped with the limit;
// test for it with errors.Is. The stream cannot be resynchronised afterwards.
var ErrEventTooLarge = errors.New("sse: event too large")

// initialBufSize is the first buffer size; the buffer doubles, up to
// maxEventSize+1, only when a single event does not fit. A chat completion
// chunk of one token is 150-400 bytes (vLLM, OpenAI), so 1 KiB holds a
// few; the buffer lives as long as the stream, and a gateway holds
// thousands of streams.
const initialBufSize = 1 << 10

// maxEmptyReads is how many (0, nil) reads in a row are tolerated before
// Next gives up with io.ErrNoProgress, as bufio does.
const maxEmptyReads = 100

// Event is one SSE event. Its slices alias the Scanner's buffers and are valid
// only until the next call to Scanner.Next; copy them to keep them.
type Event struct {
	// Raw holds the exact bytes of the event as received, byte for byte
	// (CRLF and comments kept), including its terminating blank line. Blank
	// lines that precede the event (extra separators between events) are
	// part of its Raw too, so that the Raw of successive events concatenate
	// to the stream.
	Raw []byte
	// Data holds the values of the event's data fields joined by "\n", as the
	// SSE spec assembles them, without a trailing newline. It is nil when
	// the event has no data line.
	Data []byte
	// Name is the value of the last event field, nil if there is none.
	Name []byte
	// HasData reports whether the event has at least one data line; Data
	// may still be empty ("data:" alone).
	HasData bool
}

// Scanner splits an SSE byte stream into events. It understands LF, CRLF and
// lone CR line endings, comments (lines starting with ':'), the event, id and
// retry fields (id and retry are kept in Raw but otherwise ignored), multiple
// data lines, and data values with or without the single leading space.
//
// Memory is bounded: the scanner never buffers more than maxEventSize+1
// bytes of input (plus, for an event with several data lines, its joined data,
// which is smaller), and an event larger than maxEventSize yields
// ErrEventTooLarge. The buffer starts at 1 KiB and grows only when an event
// needs it. In steady state Next does not allocate: buffers are reused.
//
// A lone CR that is the last byte received so far is held back until the next
// byte (or the end of the stream) shows whether it is half of a CRLF; so
// events are identical however the stream is split into reads. CRLF and LF
// streams are never delayed.
//
// A Scanner is not safe for concurrent use.
type Scanner struct {
	r     io.Reader
	max   int    // largest allowed event, in bytes
	limit int    // largest buffer: max+1, enough to prove an event too large
	buf   []byte // len(buf) == cap(buf); buf[end:] is free space

	start int // first byte of the pending event: its Raw starts here
	pos   int // first byte of the next line not yet parsed
	clean int // buf[pos:clean] is known to hold no CR or LF
	end   int // end of the bytes read so far

	rerr error // error from the last read, acted on once buffered bytes are parsed
	err  error // sticky error returned by Next

	// State of the pending event. Offsets are relative to start so that
	// moving the buffer contents to the front does not invalidate them.
	pending          bool // a non-blank line has been seen
	dataLines        int
	dataOff, dataEnd int // the only data value while dataLines == 1
	hasName          bool
	nameOff, nameEnd int
	dataBuf          []byte // joined data values once dataLines > 1

	// pooled is the buffer taken from bufPool, given back by Release.
	pooled *[]byte
	// waiter is r when it can wait for input without a buffer, else nil.
	waiter ReadableWaiter
}

// NewScanner returns a Scanner reading from r. maxEventSize bounds the size
// of one event in bytes, including its line endings; if it is <= 0,
// DefaultMaxEventSize is used.
func NewScanner(r io.Reader, maxEventSize int) *Scanner {
	if maxEventSize <= 0 {
		maxEventSize = DefaultMaxEventSize
	}
	limit := maxEventSize + 1
	s := &Scanner{r: r, max: maxEventSize, limit: limit}
	s.waiter, _ = r.(ReadableWaiter)
	if limit >= initialBufSize {
		s.pooled = bufPool.Get().(*[]byte)
		s.buf = *s.pooled
	} else {
		s.buf = make([]byte, limit)
	}
	return s
}

// bufPool holds initialBufSize buffers given back by Release, so that a
// gateway relaying many short streams does not allocate one per stream.
var bufPool = sync.Pool{New: func() any {
	b := make([]byte, initialBufSize)
	return &b
}}

// Release gives the scanner's buffer back for reuse by a later NewScanner.
// Call it once the stream is done with: afterwards the Events returned
// before are invalid and Next returns an error (its previous one, or
// io.ErrClosedPipe). A buffer that grew past its first size is left to the
// garbage collector (the first one, no longer used, goes back). Release is
// optional and idempotent.
func (s *Scanner) Release() {
	if s.err == nil {
		s.err = io.ErrClosedPipe
	}
	s.buf, s.dataBuf = nil, nil
	s.start, s.pos, s.clean, s.end = 0, 0, 0, 0
	if p := s.pooled; p != nil {
		s.pooled = nil
		bufPool.Put(p)
	}
}

// Next returns the next event. The Event's slices alias the scanner's buffers
// and are valid only until the next call to Next.
//
// At a clean end of the stream (end of input right after an event's blank
// line, possibly followed by more blank lines) Next returns io.EOF. When the
// input ends inside an event (bytes without the terminating blank line), the
// stream was truncated and Next returns io.ErrUnexpectedEOF. An event larger
// than the limit yields an error wrapping ErrEventTooLarge. Errors from the
// reader are returned as they are, after the events completed before them.
// Once Next has returned an error it returns the same error forever.
func (s *Scanner) Next() (Event, error) {
	if s.err != nil {
		return Event{}, s.err
	}
	s.start = s.pos
	s.resetEvent()
	for {
		ev, ok, err := s.parse()
		if err != nil {
			s.err = err
			return Event{}, err
		}
		if ok {
			return ev, nil
		}
		if s.end-s.start > s.max {
			// Checked before the read error so that the outcome does not
			// depend on whether the last bytes arrived with io.EOF.
			s.err = s.tooLarge()
			return Event{}, s.err
		}
		if s.rerr != nil {
			s.err = s.endError()
			return Event{}, s.err
		}
		s.fill()
	}
}

// NextBuffered returns the next event if it is already complete in the
// scanner's buffer, without reading; ok is false when it is not (or when
// only Next could report what comes next: an error, the end of the
// stream). It lets a relay write several events that arrived together with
// one write. The Raw of events returned since the last call to Next stays
// valid (the buffer does not move), and the Raw of successive events are
// adjacent there; an earlier event's Data and Name may not stay valid.
func (s *Scanner) NextBuffered() (ev Event, ok bool) {
	if s.err != nil || s.buf == nil {
		return Event{}, false
	}
	start := s.pos
	s.start = start
	s.resetEvent()
	ev, ok, err := s.parse()
	if ok && err == nil {
		return ev, true
	}
	// Not complete yet: forget what was parsed, so that Next parses the
	// event again from its first line once more input is in.
	s.pos, s.clean = start, start
	return Event{}, false
}

func (s *Scanner) resetEvent() {
	s.pending = false
	s.dataLines = 0
	s.hasName = false
	s.dataBuf = s.dataBuf[:0]
}

func (s *Scanner) tooLarge() error {
	return fmt.Errorf("%w: more than %d bytes", ErrEventTooLarge, s.max)
}

// endError is the error for a stream whose reader has failed or ended with
// no complete event left in the buffer.
func (s *Scanner) endError() error {
	if s.rerr != io.EOF {
		return s.rerr
	}
	if s.pending || s.pos < s.end {
		return io.ErrUnexpectedEOF
	}
	return io.EOF
}

// parse consumes complete lines from the buffer until an event is complete
// (ok) or more input is needed.
func (s *Scanner) parse() (ev Event, ok bool, err error) {
	for {
		lineEnd, next, found := s.nextLine()
		if !found {
			return Event{}, false, nil
		}
		lineStart := s.pos
		s.pos, s.clean = next, next
		if lineStart == lineEnd {
			if !s.pending {
				continue // a blank line outside an event: kept in the next Raw
			}
			if s.pos-s.start > s.max {
				return Event{}, false, s.tooLarge()
			}
			return s.event(), true, nil
		}
		s.pending = true
		s.field(lineStart, lineEnd)
	}
}

// nextLine finds the end of the line starting at pos. It returns the index of
// the line terminator and of the byte after it.
func (s *Scanner) nextLine() (lineEnd, next int, found bool) {
	b := s.buf[:s.end]
	from := max(s.clean, s.pos)
	rest := b[from:]
	lf := bytes.IndexByte(rest, '\n')
	seg := rest
	if lf >= 0 {
		seg = rest[:lf]
	}
	if cr := bytes.IndexByte(seg, '\r'); cr >= 0 {
		k := from + cr
		switch {
		case k+1 < len(b):
			if b[k+1] == '\n' {
				return k, k + 2, true
			}
			return k, k + 1, true
		case s.rerr != nil:
			return k, k + 1, true // a CR at the end of the stream ends the line
		default:
			s.clean = k // wait for the next byte: it may be the LF of a CRLF
			return 0, 0, false
		}
	}
	if lf >= 0 {
		return from + lf, from + lf + 1, true
	}
	s.clean = len(b)
	return 0, 0, false
}

// field applies one non-blank line to the pending event.
func (s *Scanner) field(lineStart, lineEnd int) {
	line := s.buf[lineStart:lineEnd]
	if line[0] == ':' {
		return // comment
	}
	name, valStart := line, lineEnd
	if colon := bytes.IndexByte(line, ':'); colon >= 0 {
		name = line[:colon]
		valStart = lineStart + colon + 1
		if valStart < lineEnd && s.buf[valStart] == ' ' {
			valStart++
		}
	}
	switch string(name) {
	case "data":
		s.addData(valStart, lineEnd)
	case "event":
		s.hasName = true
		s.nameOff, s.nameEnd = valStart-s.start, lineEnd-s.start
	}
	// id, retry and unknown fields only matter to browsers; they stay in Raw.
}

// addData records a data value. A single data line (the OpenAI case) is
// returned in place; only multi-line data is copied to be joined.
func (s *Scanner) addData(valStart, valEnd int) {
	switch s.dataLines {
	case 0:
		s.dataOff, s.dataEnd = valStart-s.start, valEnd-s.start
	case 1:
		s.dataBuf = append(s.dataBuf[:0], s.buf[s.start+s.dataOff:s.start+s.dataEnd]...)
		fallthrough
	default:
		s.dataBuf = append(s.dataBuf, '\n')
		s.dataBuf = append(s.dataBuf, s.buf[valStart:valEnd]...)
	}
	s.dataLines++
}

// event builds the completed event in buf[start:pos]. Slices are capped so
// that a caller appending to one cannot overwrite the buffer.
func (s *Scanner) event() Event {
	ev := Event{Raw: s.buf[s.start:s.pos:s.pos], HasData: s.dataLines > 0}
	switch s.dataLines {
	case 0:
	case 1:
		a, b := s.start+s.dataOff, s.start+s.dataEnd
		ev.Data = s.buf[a:b:b]
	default:
		ev.Data = s.dataBuf[:len(s.dataBuf):len(s.dataBuf)]
	}
	if s.hasName {
		a, b := s.start+s.nameOff, s.start+s.nameEnd
		ev.Name = s.buf[a:b:b]
	}
	return ev
}

// ReadableWaiter is a reader that can wait for input without a buffer: an
// upstream response body of internal/h1. Between events the Scanner gives
// its buffer back and waits with WaitReadable, so a stream waiting for its
// next token holds no read buffer. WaitReadable returns when a Read would
// not block (input, the end, an error) or at once when it cannot tell; its
// error is the one the next Read would return.
type ReadableWaiter interface {
	WaitReadable() error
}

// fill reads more input, first making room by moving the pending event to the
// front of the buffer and, if it still does not fit, growing the buffer up to
// limit. Next has already checked that the pending bytes do not exceed max,
// so there is always room for at least one more byte.
func (s *Scanner) fill() {
	if w := s.waiter; w != nil && s.start == s.end && s.pooled != nil {
		// Nothing pending: the buffer goes back while the stream waits
		// for its next event, which may be seconds away.
		p := s.pooled
		s.pooled, s.buf = nil, nil
		s.start, s.pos, s.clean, s.end = 0, 0, 0, 0
		bufPool.Put(p)
		err := w.WaitReadable()
		s.pooled = bufPool.Get().(*[]byte)
		s.buf = *s.pooled
		if err != nil {
			s.rerr = err
			return
		}
	}
	if s.end == len(s.buf) {
		if s.start > 0 {
			n := copy(s.buf, s.buf[s.start:s.end])
			s.pos -= s.start
			s.clean -= s.start
			s.end = n
			s.start = 0
		}
		if s.end == len(s.buf) {
			nb := make([]byte, min(2*len(s.buf), s.limit))
			copy(nb, s.buf[:s.end])
			s.buf = nb
		}
	}
	for range maxEmptyReads {
		n, err := s.r.Read(s.buf[s.end:])
		if n < 0 || n > len(s.buf)-s.end {
			s.rerr = fmt.Errorf("sse: reader returned invalid count %d", n)
			return
		}
		s.end += n
		if err != nil {
			s.rerr = err
			return
		}
		if n > 0 {
			return
		}
	}
	s.rerr = io.ErrNoProgress
}
