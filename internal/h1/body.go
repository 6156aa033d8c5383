package h1

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/textproto"
	"sync"
	"sync/atomic"
	"syscall"
)

// States of a body.
const (
	bodyReading = iota
	bodyDone    // read to its end; the connection was released
	bodyClosed  // closed before its end, or failed; the connection was closed
)

// How a body is delimited.
const (
	modeLength  = iota // Content-Length: left bytes
	modeChunked        // chunked transfer coding
	modeClose          // until the server closes the connection
)

// States of the chunked decoder.
const (
	chunkSize    = iota // expecting a chunk-size line
	chunkData           // left bytes of chunk data to go
	chunkCRLF           // expecting the CRLF that ends chunk data
	chunkTrailer        // after the last chunk: trailer lines up to an empty one
)

// The chunked decoder's bounds are net/http's (net/http/internal's
// chunked.go and transfer.go's readTrailer): a chunk line, extensions
// included, fits in the read buffer and is under maxChunkLine bytes; the
// trailer section fits in the read buffer; chunk lines and extensions may
// exceed the data they carry by at most maxChunkExcess bytes.
const (
	maxChunkLine   = 4096
	maxChunkExcess = 16 << 10
)

var (
	errReadOnClosedBody = errors.New("h1: read on closed response body")
	errChunkLine        = malformed(errors.New("malformed chunked encoding"))
	errChunkBareLF      = malformed(errors.New("chunked line ends with bare LF"))
	errChunkCR          = malformed(errors.New("invalid CR in chunked line"))
	errChunkLineLong    = malformed(errors.New("chunk line too long"))
	errChunkExcess      = malformed(errors.New("chunked encoding contains too much non-data"))
	errTrailerLong      = malformed(errors.New("suspiciously long trailer after chunked body"))
)

// body is a response body read from its connection on the caller's
// goroutine, through a buffer it holds only while bytes are in it: a stream
// waiting for its next event (WaitReadable) holds none. Read and Close may
// run concurrently (Close aborts a blocked Read); Reads must not.
type body struct {
	c    *conn
	resp *http.Response // its Trailer is filled at the end of a chunked body
	stop func() bool    // stops the context's close of the connection

	buf  []byte // nil while released; buf[r:w] is read, not yet returned
	r, w int
	bufp *[]byte    // the pool's pointer to buf, nil when buf was grown
	pool *sync.Pool // the transport's buffers, of size
	size int        // the buffer size to take

	mode   int
	left   int64 // modeLength: bytes to go; modeChunked: of the current chunk
	chunk  int   // chunked decoder state
	excess int64 // chunked: overhead beyond what the data allows (net/http's rule)

	state atomic.Int32
	err   error // sticky once the body failed

	// rc, readFn and rerr serve WaitReadable's raw read (sys_unix.go):
	// the method value is made once per body, not per event.
	rc     syscall.RawConn
	readFn func(fd uintptr) bool
	rerr   error
}

// buffersHeld counts the read buffers bodies hold now (tests).
var buffersHeld atomic.Int64

func (b *body) takeBuf() {
	buffersHeld.Add(1)
	if v := b.pool.Get(); v != nil {
		b.bufp = v.(*[]byte)
	} else {
		buf := make([]byte, b.size)
		b.bufp = &buf
	}
	b.buf = *b.bufp
	b.r, b.w = 0, 0
}

// dropBuf gives the buffer back; what it held must have been consumed.
func (b *body) dropBuf() {
	if b.bufp != nil {
		buffersHeld.Add(-1)
		b.pool.Put(b.bufp)
		b.bufp = nil
	}
	b.buf, b.r, b.w = nil, 0, 0
}

// adopt takes the bytes the head's reader read past the head.
func (b *body) adopt(br *bufio.Reader) {
	b.size, b.pool = b.c.t.readBufferSize(), &b.c.t.bufs
	if n := br.Buffered(); n > 0 {
		b.takeBuf()
		peek, _ := br.Peek(n)
		b.w = copy(b.buf, peek)
	}
}

// fill reads more bytes into the buffer, after those not yet consumed;
// it fails with errChunkLineLong when the buffer is full of them (a line
// being parsed must fit in it, as in net/http's bufio.Reader).
func (b *body) fill() error {
	if b.buf == nil {
		b.takeBuf()
	}
	if b.r > 0 && b.r == b.w {
		b.r, b.w = 0, 0
	}
	if b.w == len(b.buf) {
		if b.r == 0 {
			return errChunkLineLong
		}
		b.w = copy(b.buf, b.buf[b.r:b.w])
		b.r = 0
	}
	n, err := b.c.nc.Read(b.buf[b.w:])
	b.w += n
	if n > 0 {
		return nil
	}
	if err == nil {
		err = io.ErrNoProgress
	}
	return err
}

// chunkLine returns the next chunk line without its CRLF, reading as
// needed; as net/http it must end in CRLF with no other CR in it. Its
// bytes alias the buffer until the next fill.
func (b *body) chunkLine() ([]byte, error) {
	for {
		if i := bytes.IndexByte(b.buf[b.r:b.w], '\n'); i >= 0 {
			ln := b.buf[b.r : b.r+i+1]
			b.r += i + 1
			switch cr := bytes.IndexByte(ln, '\r'); {
			case cr < 0:
				return nil, errChunkBareLF
			case cr != len(ln)-2:
				return nil, errChunkCR
			}
			ln = ln[:len(ln)-2]
			if len(ln) >= maxChunkLine {
				return nil, errChunkLineLong
			}
			return ln, nil
		}
		if err := b.fill(); err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
	}
}

// need reads until n bytes are buffered; io.EOF before is
// io.ErrUnexpectedEOF.
func (b *body) need(n int) error {
	for b.w-b.r < n {
		if err := b.fill(); err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return err
		}
	}
	return nil
}

// Read reads the body. At its end the connection is released (to the idle
// pool when it can carry another request) before io.EOF is returned.
func (b *body) Read(p []byte) (int, error) {
	switch st := b.state.Load(); {
	case st == bodyDone:
		return 0, io.EOF
	case b.err != nil:
		return 0, b.err
	case st == bodyClosed:
		return 0, errReadOnClosedBody
	}
	if len(p) == 0 {
		return 0, nil
	}
	n, err := b.read(p)
	if err == io.EOF {
		b.finish()
		return n, io.EOF
	}
	if err != nil {
		b.fail(b.c.abortErr(err))
		return n, b.err
	}
	return n, nil
}

// read reads body bytes by the framing; io.EOF is the body's end.
func (b *body) read(p []byte) (int, error) {
	switch b.mode {
	case modeLength:
		if b.left == 0 {
			return 0, io.EOF
		}
		if int64(len(p)) > b.left {
			p = p[:b.left]
		}
		n, err := b.data(p)
		b.left -= int64(n)
		if b.left == 0 {
			return n, io.EOF
		}
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return n, err
	case modeClose:
		n, err := b.data(p)
		if err == io.EOF {
			b.c.keepAlive = false // the end, and of the connection too
		}
		return n, err
	}
	return b.readChunked(p)
}

// data returns buffered bytes, or reads straight into p when none are
// buffered.
func (b *body) data(p []byte) (int, error) {
	if b.r < b.w {
		n := copy(p, b.buf[b.r:b.w])
		b.r += n
		return n, nil
	}
	n, err := b.c.nc.Read(p)
	if n > 0 {
		return n, nil
	}
	if err == nil {
		err = io.ErrNoProgress
	}
	return 0, err
}

// readChunked decodes the chunked transfer coding (RFC 9112 §7.1) with
// net/http's checks: it returns chunk data as it arrives, and io.EOF after
// the last chunk and its trailer section, whose fields go to
// Response.Trailer.
func (b *body) readChunked(p []byte) (int, error) {
	for {
		switch b.chunk {
		case chunkSize:
			ln, err := b.chunkLine()
			if err != nil {
				return 0, err
			}
			b.excess += int64(len(ln)) + 2 // the line, and the CRLF after its data
			size, err := parseChunkSize(ln)
			if err != nil {
				return 0, err
			}
			b.excess = max(b.excess-16-2*min(size, 1<<40), 0)
			if b.excess > maxChunkExcess {
				return 0, errChunkExcess
			}
			if size == 0 {
				b.chunk = chunkTrailer
				continue
			}
			b.left, b.chunk = size, chunkData
		case chunkData:
			if int64(len(p)) > b.left {
				p = p[:b.left]
			}
			n, err := b.data(p)
			b.left -= int64(n)
			if b.left == 0 {
				b.chunk = chunkCRLF
			}
			if n > 0 {
				return n, nil
			}
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return 0, err
		case chunkCRLF:
			if err := b.need(2); err != nil {
				return 0, err
			}
			if b.buf[b.r] != '\r' || b.buf[b.r+1] != '\n' {
				return 0, errChunkLine
			}
			b.r += 2
			b.chunk = chunkSize
		case chunkTrailer:
			if err := b.readTrailer(); err != nil {
				return 0, err
			}
			return 0, io.EOF
		}
	}
}

// readTrailer reads the trailer section after the last chunk as net/http
// does: an empty line, or fields up to a CRLF CRLF that must be in the
// read buffer (no trailer section holds a stream longer than one buffer
// takes to fill), parsed by textproto into Response.Trailer.
func (b *body) readTrailer() error {
	if err := b.need(2); err != nil {
		return err
	}
	if b.buf[b.r] == '\r' && b.buf[b.r+1] == '\n' {
		b.r += 2
		return nil
	}
	for bytes.Index(b.buf[b.r:b.w], crlfCRLF) < 0 {
		if err := b.fill(); err != nil {
			if err == errChunkLineLong {
				err = errTrailerLong
			} else if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return err
		}
	}
	src := bytes.NewReader(b.buf[b.r:b.w])
	br := bufio.NewReaderSize(src, max(16, b.w-b.r))
	h, err := textproto.NewReader(br).ReadMIMEHeader()
	b.r = b.w - src.Len() - br.Buffered()
	if err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return malformed(err)
	}
	if b.resp.Trailer == nil {
		b.resp.Trailer = http.Header(h)
	} else {
		maps.Copy(b.resp.Trailer, http.Header(h))
	}
	return nil
}

var crlfCRLF = []byte("\r\n\r\n")

// parseChunkSize reads a chunk-size line as net/http does: trailing
// whitespace trimmed, then ";extensions" cut (and ignored), then 1 to 16
// hex digits and nothing else.
func parseChunkSize(ln []byte) (int64, error) {
	ln = bytes.TrimRight(ln, " \t")
	if i := bytes.IndexByte(ln, ';'); i >= 0 {
		ln = ln[:i]
	}
	if len(ln) == 0 || len(ln) > 16 {
		return 0, errChunkLine
	}
	var n uint64
	for _, c := range ln {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			c = c - 'A' + 10
		default:
			return 0, malformed(fmt.Errorf("invalid byte in chunk length %q", ln))
		}
		n = n<<4 | uint64(c)
	}
	if n > 1<<62 {
		return 0, errChunkLine
	}
	return int64(n), nil
}

// finish ends a body read to its end: the connection goes back to the
// pool when nothing is left in the buffer.
func (b *body) finish() {
	if b.state.CompareAndSwap(bodyReading, bodyDone) {
		b.releaseConn()
	}
}

// releaseConn gives back the buffer and the connection of a body at its
// end: to the idle pool when nothing is left in the buffer.
func (b *body) releaseConn() {
	clean := b.r == b.w
	b.dropBuf()
	b.c.release(b.stop, clean)
}

// fail ends a body on a read error: the connection is closed.
func (b *body) fail(err error) {
	b.err = err
	if b.state.CompareAndSwap(bodyReading, bodyClosed) {
		b.stop()
		_ = b.c.nc.Close()
		b.dropBuf()
	}
}

// Close closes the body. Before its end that closes the connection: a
// stream abandoned midway is not drained. Its buffer is left to the
// garbage collector, as a Read may still be using it.
func (b *body) Close() error {
	if b.state.CompareAndSwap(bodyReading, bodyClosed) {
		b.stop()
		_ = b.c.nc.Close()
	}
	return nil
}

// WaitReadable blocks until the body has bytes to read (or its connection
// has news: its end, an error), holding no buffer while it waits, and reads
// them into a buffer taken once they are there. A relay calls it between
// events so that a stream waiting for its next token holds no read buffer;
// the read it does is the one Read would have done, so it costs no extra
// system call. It returns at once when bytes are buffered or the
// connection is not a plain socket; an error is the one the next Read
// would return.
func (b *body) WaitReadable() error {
	if b.state.Load() != bodyReading || b.err != nil {
		return nil
	}
	if b.mode == modeChunked && b.chunk == chunkCRLF && b.w-b.r >= 2 && b.buf[b.r] == '\r' && b.buf[b.r+1] == '\n' {
		// The CRLF that ends the chunk just read is no data to wait for.
		b.r += 2
		b.chunk = chunkSize
	}
	if b.r < b.w {
		return nil
	}
	b.r, b.w = 0, 0
	ok, err := b.waitRead()
	if !ok {
		return nil
	}
	if err == io.EOF {
		// The server closed: the next Read tells the framing's end
		// from a truncation.
		return nil
	}
	if err != nil {
		err = b.c.abortErr(err)
		b.fail(err)
		return err
	}
	return nil
}
