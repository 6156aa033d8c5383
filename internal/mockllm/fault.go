package mockllm

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"
)

// FaultKind names a failure a replica can inject.
type FaultKind string

// The fault kinds. Outcomes in RequestRecord and keys of ReplicaStats.Faults
// use these names.
const (
	// FaultNone injects nothing.
	FaultNone FaultKind = ""
	// FaultStatus answers at once with Fault.Status and a vLLM-shaped JSON
	// error body (and Retry-After when Fault.RetryAfter is set).
	FaultStatus FaultKind = "status"
	// FaultHang reads the request and never answers, until the client
	// goes away.
	FaultHang FaultKind = "hang"
	// FaultHangAfterHeaders sends 200 and the response headers, flushes,
	// then never sends a body byte (comments still flow with
	// comment_every=DURATION).
	FaultHangAfterHeaders FaultKind = "hang_after_headers"
	// FaultReset reads the request and closes the TCP connection with RST
	// before any response byte.
	FaultReset FaultKind = "reset"
	// FaultCut closes the connection cleanly (FIN) after Fault.After
	// content events, when the next token is due, leaving a truncated
	// chunked body: no finish_reason (unless After >= tokens), no usage,
	// no [DONE]. A non-streaming response promises its full
	// Content-Length and is cut halfway.
	FaultCut FaultKind = "cut"
	// FaultCutRST is FaultCut with a TCP RST instead of a FIN. The
	// client's kernel may discard bytes it has not read yet.
	FaultCutRST FaultKind = "cut_rst"
	// FaultErrorEvent sends an in-band error event after Fault.After
	// content events and ends the stream properly (no [DONE]). A
	// non-streaming request gets Fault.ErrorCode as its HTTP status.
	// The event is the API's own: Chat and Completions
	// data: {"error":{…}}; Responses event: error (or response.failed
	// with Fault.ResponseFailed); Messages event: error with
	// {"type":"error","error":{"type":…}}. On Responses and Messages
	// error_event=0 comes after the stream's lifecycle events
	// (response.created + response.in_progress, message_start + ping):
	// lifecycle-then-error, nothing generated.
	FaultErrorEvent FaultKind = "error_event"
)

// Fault is the failure a replica injects into completion requests: one
// kind plus modifiers. Its text form (ParseFault, String) is a
// comma-separated list such as "status=503,every=3,retry_after=2" or
// "cut=40" or "fragment=1".
type Fault struct {
	// Kind is the failure; FaultNone means only the stream modifiers
	// (Fragment, CommentEvery, CommentInterval) apply.
	Kind FaultKind
	// Status is the HTTP status of a FaultStatus (400-599).
	Status int
	// After is the number of content (token) events sent before a
	// FaultCut, FaultCutRST or FaultErrorEvent; 0 means right after the
	// response headers, before any data event. When it is not below the
	// number of tokens, the fault comes after the last token event (which
	// carries finish_reason) and before the usage chunk and [DONE].
	After int
	// ErrorCode is the code of a FaultErrorEvent (400-599, default 500);
	// it also picks the error type ("BadRequestError" for 400, ...; on
	// Messages "overloaded_error" for 503 and 529, "api_error" for other
	// 5xx, "rate_limit_error" for 429, ...; on Responses the code
	// "server_error" for 5xx, "rate_limit_exceeded" for 429,
	// "invalid_prompt" for other 4xx).
	ErrorCode int
	// ErrorType replaces the error type that ErrorCode picks (Chat's
	// "type", Responses' "code", Messages' error.type), e.g.
	// "overloaded_error". Letters, digits and '_' only.
	ErrorType string
	// ResponseFailed makes a FaultErrorEvent on a Responses stream a
	// response.failed event (status "failed", error {code, message})
	// instead of an error event. Other APIs ignore it.
	ResponseFailed bool
	// RetryAfter, in seconds, sets Retry-After on a FaultStatus response.
	// Zero means no header.
	RetryAfter int
	// Every makes the fault hit only every Every-th completion request
	// received by the replica (counted since start or the last reset).
	Every int
	// Fraction makes the fault hit a random fraction of requests (from the
	// replica's seeded generator). Zero, with Every zero, means always.
	Fraction float64
	// Fragment writes the response body in writes of this many bytes,
	// each flushed, splitting events and UTF-8 characters across writes.
	Fragment int
	// CommentEvery sends an SSE comment ": ping" after every CommentEvery
	// content events.
	CommentEvery int
	// CommentInterval sends the response headers at once and an SSE
	// comment ": ping" at this interval while the stream waits (queue,
	// TTFT, between tokens, hang_after_headers).
	CommentInterval time.Duration
}

// IsZero reports whether f injects nothing at all.
func (f Fault) IsZero() bool { return f == Fault{} }

// String formats f as ParseFault accepts it; "" for the zero Fault.
func (f Fault) String() string {
	var items []string
	add := func(k string, v int) {
		if v != 0 {
			items = append(items, k+"="+strconv.Itoa(v))
		}
	}
	switch f.Kind {
	case FaultNone:
	case FaultStatus:
		items = append(items, "status="+strconv.Itoa(f.Status))
	case FaultCut, FaultCutRST, FaultErrorEvent:
		items = append(items, string(f.Kind)+"="+strconv.Itoa(f.After))
	default:
		items = append(items, string(f.Kind))
	}
	add("every", f.Every)
	if f.Fraction != 0 {
		items = append(items, "fraction="+strconv.FormatFloat(f.Fraction, 'g', -1, 64))
	}
	add("retry_after", f.RetryAfter)
	add("error_code", f.ErrorCode)
	if f.ErrorType != "" {
		items = append(items, "error_type="+f.ErrorType)
	}
	if f.ResponseFailed {
		items = append(items, "response_failed")
	}
	add("fragment", f.Fragment)
	add("comment_every", f.CommentEvery)
	if f.CommentInterval != 0 {
		items = append(items, "comment_every="+f.CommentInterval.String())
	}
	return strings.Join(items, ",")
}

// ParseFault parses a fault spec: comma-separated key[=value] items, at
// most one fault kind plus modifiers. "" and "none" yield the zero Fault.
//
// Kinds:
//
//	status=CODE          answer CODE (400-599) with a vLLM-shaped error body
//	hang                 never answer
//	hang_after_headers   send 200 + headers, then nothing
//	reset                close with TCP RST before any response byte
//	cut=N                close (FIN) after N content events
//	cut_rst=N            close (RST) after N content events
//	error_event=N        in-band error event after N content events
//
// Modifiers:
//
//	every=N              only every N-th request to the replica
//	fraction=F           only a random fraction F (0 < F <= 1)
//	retry_after=SECONDS  Retry-After header (status only; >= 1)
//	error_code=CODE      code and type of the error event (error_event only)
//	error_type=NAME      the error event's type/code instead of the one CODE picks
//	response_failed      Responses: response.failed instead of event: error
//	fragment=N           write the body N bytes at a time, flushing each
//	comment_every=N      ": ping" comment after every N content events
//	comment_every=DUR    headers at once, then ": ping" every DUR while waiting
func ParseFault(s string) (Fault, error) {
	var f Fault
	s = strings.TrimSpace(s)
	if s == "" || s == "none" {
		return f, nil
	}
	seen := map[string]bool{}
	for item := range strings.SplitSeq(s, ",") {
		k, v, hasValue := strings.Cut(strings.TrimSpace(item), "=")
		k = strings.ReplaceAll(strings.ToLower(strings.TrimSpace(k)), "-", "_")
		v = strings.TrimSpace(v)
		if seen[k] {
			return Fault{}, fmt.Errorf("fault %q: %q given twice", s, k)
		}
		seen[k] = true
		if err := f.set(k, v, hasValue); err != nil {
			return Fault{}, fmt.Errorf("fault %q: %w", s, err)
		}
	}
	if err := f.Validate(); err != nil {
		return Fault{}, fmt.Errorf("fault %q: %w", s, err)
	}
	return f, nil
}

// set applies one item of a fault spec.
func (f *Fault) set(k, v string, hasValue bool) error {
	kind := func(kk FaultKind) error {
		if f.Kind != FaultNone {
			return fmt.Errorf("two fault kinds (%s and %s)", f.Kind, kk)
		}
		f.Kind = kk
		return nil
	}
	needValue := func() error {
		if !hasValue || v == "" {
			return fmt.Errorf("%s needs a value", k)
		}
		return nil
	}
	var err error
	switch k {
	case "hang", "hang_after_headers", "reset":
		if hasValue {
			return fmt.Errorf("%s takes no value", k)
		}
		return kind(FaultKind(k))
	case "status":
		if err = needValue(); err == nil {
			f.Status, err = parseStatus(v)
		}
		if err == nil {
			err = kind(FaultStatus)
		}
	case "cut", "cut_rst", "error_event":
		if err = needValue(); err == nil {
			f.After, err = parseCount(v, maxCount)
		}
		if err == nil {
			err = kind(FaultKind(k))
		}
	case "every":
		if err = needValue(); err == nil {
			f.Every, err = parseCount(v, maxCount)
		}
		if err == nil && f.Every == 0 {
			err = errors.New("every must be >= 1")
		}
	case "fraction":
		if err = needValue(); err == nil {
			f.Fraction, err = parseFraction(v)
		}
		if err == nil && f.Fraction == 0 {
			err = errors.New("fraction must be > 0")
		}
	case "retry_after":
		if err = needValue(); err == nil {
			f.RetryAfter, err = parseCount(v, maxCount)
		}
		if err == nil && f.RetryAfter == 0 {
			err = errors.New("retry_after must be >= 1")
		}
	case "error_code":
		if err = needValue(); err == nil {
			f.ErrorCode, err = parseStatus(v)
		}
	case "error_type":
		if err = needValue(); err == nil {
			if !validErrorType(v) {
				return fmt.Errorf("error_type %q: want 1-64 letters, digits or '_'", v)
			}
			f.ErrorType = v
		}
	case "response_failed":
		if hasValue {
			return fmt.Errorf("%s takes no value", k)
		}
		f.ResponseFailed = true
	case "fragment":
		if err = needValue(); err == nil {
			f.Fragment, err = parseCount(v, maxTokenBytes)
		}
		if err == nil && f.Fragment == 0 {
			err = errors.New("fragment must be >= 1")
		}
	case "comment_every":
		if err = needValue(); err != nil {
			return err
		}
		if n, cerr := strconv.Atoi(v); cerr == nil {
			if n < 1 || n > maxCount {
				return fmt.Errorf("comment_every %d: want [1, %d] or a duration", n, maxCount)
			}
			f.CommentEvery = n
			return nil
		}
		if f.CommentInterval, err = parseDuration(v); err == nil && f.CommentInterval == 0 {
			err = errors.New("comment_every must be > 0")
		}
	default:
		return fmt.Errorf("unknown item %q", k)
	}
	return err
}

// Validate reports inconsistent faults: modifiers without the kind they
// modify, out-of-range values.
func (f Fault) Validate() error {
	switch f.Kind {
	case FaultNone, FaultHang, FaultHangAfterHeaders, FaultReset, FaultCut, FaultCutRST, FaultErrorEvent:
	case FaultStatus:
		if f.Status < 400 || f.Status > 599 {
			return fmt.Errorf("status %d: want 400-599", f.Status)
		}
	default:
		return fmt.Errorf("unknown fault kind %q", f.Kind)
	}
	switch {
	case f.After < 0 || f.Every < 0 || f.RetryAfter < 0 || f.Fragment < 0 || f.CommentEvery < 0 || f.CommentInterval < 0:
		return errors.New("negative value")
	case math.IsNaN(f.Fraction) || f.Fraction < 0 || f.Fraction > 1:
		return fmt.Errorf("fraction %v: want (0, 1]", f.Fraction)
	case f.Kind == FaultNone && (f.Every != 0 || f.Fraction != 0):
		return errors.New("every/fraction need a fault kind")
	case f.Every != 0 && f.Fraction != 0:
		return errors.New("every and fraction are exclusive")
	case f.RetryAfter != 0 && f.Kind != FaultStatus:
		return errors.New("retry_after needs status")
	case f.ErrorCode != 0 && f.Kind != FaultErrorEvent:
		return errors.New("error_code needs error_event")
	case (f.ErrorType != "" || f.ResponseFailed) && f.Kind != FaultErrorEvent:
		return errors.New("error_type and response_failed need error_event")
	case f.ErrorType != "" && !validErrorType(f.ErrorType):
		return fmt.Errorf("error_type %q: want 1-64 letters, digits or '_'", f.ErrorType)
	case f.ErrorCode != 0 && (f.ErrorCode < 400 || f.ErrorCode > 599):
		return fmt.Errorf("error_code %d: want 400-599", f.ErrorCode)
	case f.CommentEvery != 0 && f.CommentInterval != 0:
		return errors.New("comment_every given twice")
	}
	return nil
}

// hits reports whether the fault's kind applies to the seq-th request
// (1-based) of the replica.
func (f Fault) hits(seq int64, rng *rand.Rand) bool {
	switch {
	case f.Kind == FaultNone:
		return false
	case f.Every > 0:
		return seq%int64(f.Every) == 0
	case f.Fraction > 0:
		return rng.Float64() < f.Fraction
	}
	return true
}

func parseStatus(s string) (int, error) {
	n, err := parseCount(s, 599)
	if err != nil || n < 400 {
		return 0, fmt.Errorf("status %q: want 400-599", s)
	}
	return n, nil
}

// validErrorType reports whether s is 1-64 ASCII letters, digits or '_'.
func validErrorType(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for _, c := range s {
		if !(c == '_' || c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z') {
			return false
		}
	}
	return true
}
