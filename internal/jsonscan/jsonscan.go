// Package jsonscan walks JSON text in place, without decoding it and
// without allocating: the one JSON scanner of the gateway, used to parse
// request bodies (strictly: what encoding/json refuses, it refuses) and to
// inspect upstream events (loosely: what it cannot understand it stops
// reading, and never panics).
//
// An Iter walks the members of one object or the elements of one array;
// a value is either consumed whole (Value) or walked by a child Iter
// (Enter, then Leave). Keys and strings stay raw (escapes undecoded):
// KeyIs compares a raw key with a name, String decodes when a caller must
// keep the text. The package imports only the standard library.
package jsonscan

import (
	"bytes"
	"encoding/json"
	"unicode/utf8"
)

// MaxDepth is the deepest nesting a strict walk accepts, encoding/json's
// own limit: json.Valid refuses a document nested deeper.
const MaxDepth = 10000

// IsSpace reports whether c is JSON whitespace.
func IsSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// SkipSpace returns the index of the first byte at or after i that is not
// JSON whitespace (len(b) when there is none).
func SkipSpace(b []byte, i int) int {
	for i < len(b) && IsSpace(b[i]) {
		i++
	}
	return i
}

// TrimSpace returns b without its leading and trailing JSON whitespace.
func TrimSpace(b []byte) []byte {
	i, j := 0, len(b)
	for i < j && IsSpace(b[i]) {
		i++
	}
	for j > i && IsSpace(b[j-1]) {
		j--
	}
	return b[i:j]
}

// Valid reports whether b is one valid JSON text, exactly as json.Valid
// does (FuzzValidMatchesEncodingJSON), walking it once.
func Valid(b []byte) bool {
	i := SkipSpace(b, 0)
	if i >= len(b) {
		return false
	}
	e := skipStrict(b, i, 0)
	return e >= 0 && SkipSpace(b, e) == len(b)
}

// stringByte marks the bytes a string scan must stop at: the quote, the
// backslash and (strict) the control characters JSON forbids unescaped.
var stringByte = func() (t [256]bool) {
	for c := 0; c < 0x20; c++ {
		t[c] = true
	}
	t['"'], t['\\'] = true, true
	return t
}()

// stringEnd returns the index after the string whose opening quote is at
// b[i], or -1 when it does not end or (strict) holds a control character
// or an invalid escape. Invalid UTF-8 is accepted, as encoding/json does.
func stringEnd(b []byte, i int, strict bool) int {
	for j := i + 1; j < len(b); {
		c := b[j]
		if !stringByte[c] {
			j++
			continue
		}
		switch {
		case c == '"':
			return j + 1
		case c != '\\':
			if strict {
				return -1
			}
			j++
		case j+1 >= len(b):
			return -1
		case !strict:
			j += 2
		default:
			switch b[j+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				j += 2
			case 'u':
				if j+6 > len(b) {
					return -1
				}
				if _, ok := hex4(b[j+2 : j+6]); !ok {
					return -1
				}
				j += 6
			default:
				return -1
			}
		}
	}
	return -1
}

// numberEnd returns the index after the JSON number at b[i], or -1 when
// it is not one (a leading zero before digits ends the number there; the
// caller's next check refuses the digit that follows).
func numberEnd(b []byte, i int) int {
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i >= len(b):
		return -1
	case b[i] == '0':
		i++
	case b[i] >= '1' && b[i] <= '9':
		i = digits(b, i)
	default:
		return -1
	}
	if i < len(b) && b[i] == '.' {
		j := digits(b, i+1)
		if j == i+1 {
			return -1
		}
		i = j
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		j := digits(b, i)
		if j == i {
			return -1
		}
		i = j
	}
	return i
}

func digits(b []byte, i int) int {
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		i++
	}
	return i
}

// scalarEnd returns the index after the string, number or literal at b[i]
// (strict: valid JSON only), or -1.
func scalarEnd(b []byte, i int, strict bool) int {
	switch c := b[i]; {
	case c == '"':
		return stringEnd(b, i, strict)
	case !strict:
		// Loose: a number or literal runs to the next delimiter, so that
		// Python's NaN and -Infinity in a logprob do not end the walk.
		j := i
		for j < len(b) && !IsSpace(b[j]) && b[j] != ',' && b[j] != '}' && b[j] != ']' && b[j] != ':' {
			j++
		}
		if j == i {
			return -1
		}
		return j
	case c == 't':
		return literalEnd(b, i, "true")
	case c == 'f':
		return literalEnd(b, i, "false")
	case c == 'n':
		return literalEnd(b, i, "null")
	}
	return numberEnd(b, i)
}

func literalEnd(b []byte, i int, lit string) int {
	if !bytes.HasPrefix(b[i:], []byte(lit)) {
		return -1
	}
	return i + len(lit)
}

// skipStrict returns the index after the valid JSON value at b[i], nested
// at most MaxDepth-depth levels, or -1. Nesting is tracked in a bit stack,
// not recursed, so deep input cannot exhaust the goroutine stack; it
// allocates only past 256 levels.
func skipStrict(b []byte, i, depth int) int {
	if c := b[i]; c != '{' && c != '[' {
		return scalarEnd(b, i, true)
	}
	var small [4]uint64
	inObject := small[:] // bit d: level d is an object; grown past 256 levels
	base := depth
	for {
		// A value starts at b[i].
		if i >= len(b) {
			return -1
		}
		switch c := b[i]; c {
		case '{', '[':
			if depth++; depth > MaxDepth {
				return -1
			}
			d := depth - base
			for d/64 >= len(inObject) {
				inObject = append(inObject, 0)
			}
			obj := c == '{'
			if obj {
				inObject[d/64] |= 1 << (d % 64)
			} else {
				inObject[d/64] &^= 1 << (d % 64)
			}
			i = SkipSpace(b, i+1)
			if i < len(b) && (b[i] == '}' && obj || b[i] == ']' && !obj) {
				depth--
				i++
				break
			}
			if obj {
				if i = memberValue(b, i); i < 0 {
					return -1
				}
			}
			continue
		default:
			if i = scalarEnd(b, i, true); i < 0 {
				return -1
			}
		}
		// A value ended at i: close containers, or go on to the next value.
		for {
			if depth == base {
				return i
			}
			d := depth - base
			obj := inObject[d/64]&(1<<(d%64)) != 0
			i = SkipSpace(b, i)
			if i >= len(b) {
				return -1
			}
			if b[i] == '}' && obj || b[i] == ']' && !obj {
				depth--
				i++
				continue
			}
			if b[i] != ',' {
				return -1
			}
			i = SkipSpace(b, i+1)
			if obj {
				if i = memberValue(b, i); i < 0 {
					return -1
				}
			}
			break
		}
	}
}

// memberValue reads a member's key (at b[i]) and colon, and returns the
// index of its value, or -1.
func memberValue(b []byte, i int) int {
	if i >= len(b) || b[i] != '"' {
		return -1
	}
	if i = stringEnd(b, i, true); i < 0 {
		return -1
	}
	i = SkipSpace(b, i)
	if i >= len(b) || b[i] != ':' {
		return -1
	}
	return SkipSpace(b, i+1)
}

// structural marks the bytes that a loose skip of a container must look
// at; every other byte is passed with one table lookup.
var structural = [256]bool{'"': true, '{': true, '[': true, '}': true, ']': true}

// skipLoose returns the index after the JSON value at b[i], or -1 when it
// is cut short or starts with a delimiter. Inside a container only strings
// and brackets are followed; nesting is counted, not recursed.
func skipLoose(b []byte, i int) int {
	switch b[i] {
	case '{', '[':
	case '}', ']', ',', ':':
		return -1
	default:
		return scalarEnd(b, i, false)
	}
	depth := 0
	for i < len(b) {
		if !structural[b[i]] {
			i++
			continue
		}
		switch b[i] {
		case '"':
			if i = stringEnd(b, i, false); i < 0 {
				return -1
			}
			continue
		case '{', '[':
			depth++
		case '}', ']':
			if depth--; depth == 0 {
				return i + 1
			}
		}
		i++
	}
	return -1
}

// Iter walks the members of one object or the elements of one array. Its
// zero value is done; Object, Array and Enter make one. A strict Iter
// accepts only valid JSON (End is -1 at the first byte that is not); a
// loose one reads as far as the input makes sense.
type Iter struct {
	b      []byte
	i      int
	depth  int
	array  bool
	strict bool
	more   bool // a value has been read: the next one needs a comma
	end    int  // once done: the index after the closing bracket, or -1
}

// Object returns an Iter over the object that starts at b[i] (its '{'
// after optional whitespace), strict or loose. ok is false when there is
// no object there.
func Object(b []byte, i int, strict bool) (it Iter, ok bool) {
	return open(b, i, strict, '{')
}

// Array returns an Iter over the array that starts at b[i] (after
// optional whitespace), strict or loose; ok is false when there is none.
func Array(b []byte, i int, strict bool) (it Iter, ok bool) {
	return open(b, i, strict, '[')
}

func open(b []byte, i int, strict bool, c byte) (Iter, bool) {
	i = SkipSpace(b, i)
	if i >= len(b) || b[i] != c {
		return Iter{end: -1}, false
	}
	return Iter{b: b, i: i + 1, depth: 1, array: c == '[', strict: strict}, true
}

// next moves to the next value, past a comma when one is due. It reports
// false at the closing bracket (End the index after it) or at malformed
// input (End -1).
func (it *Iter) next() bool {
	if it.b == nil {
		return false
	}
	closer := byte('}')
	if it.array {
		closer = ']'
	}
	b := it.b
	i := SkipSpace(b, it.i)
	if i < len(b) && b[i] == closer {
		return it.done(i + 1)
	}
	if it.more {
		if i >= len(b) || b[i] != ',' {
			return it.done(-1)
		}
		i = SkipSpace(b, i+1)
	}
	it.i, it.more = i, true
	if i >= len(b) {
		return it.done(-1)
	}
	return true
}

// done ends the walk at end and reports false.
func (it *Iter) done(end int) bool {
	it.end, it.b = end, nil
	return false
}

// NextKey returns the raw key of the next member (between its quotes,
// escapes undecoded) and leaves the Iter at its value, which the caller
// consumes with Value or Enter. ok is false at the end of the object or
// at malformed input.
func (it *Iter) NextKey() (key []byte, ok bool) {
	if !it.next() {
		return nil, false
	}
	b, i := it.b, it.i
	if b[i] != '"' {
		return nil, it.done(-1)
	}
	ke := stringEnd(b, i, it.strict)
	if ke < 0 {
		return nil, it.done(-1)
	}
	j := SkipSpace(b, ke)
	if j >= len(b) || b[j] != ':' {
		return nil, it.done(-1)
	}
	if j = SkipSpace(b, j+1); j >= len(b) {
		return nil, it.done(-1)
	}
	it.i = j
	return b[i+1 : ke-1], true
}

// NextElem moves the Iter to the next array element, which the caller
// consumes with Value or Enter; false at the end of the array or at
// malformed input.
func (it *Iter) NextElem() bool { return it.next() }

// IsArray reports whether the Iter walks an array (else an object).
func (it *Iter) IsArray() bool { return it.array }

// Peek returns the first byte of the current value ('"', '{', '[', a
// digit, ...): its JSON type.
func (it *Iter) Peek() byte { return it.b[it.i] }

// Pos returns the index in the walked text of the current value (before
// Value or Enter) or of the byte after the last one consumed.
func (it *Iter) Pos() int { return it.i }

// Value consumes the current value and returns its raw text (never empty).
// ok is false when the value is malformed; the walk is then over.
func (it *Iter) Value() (val []byte, ok bool) {
	var e int
	if it.strict {
		e = skipStrict(it.b, it.i, it.depth)
	} else {
		e = skipLoose(it.b, it.i)
	}
	if e <= it.i {
		return nil, it.done(-1)
	}
	val, it.i = it.b[it.i:e], e
	return val, true
}

// Enter returns an Iter over the current value, an object or array (see
// Peek), one level deeper. After walking it to its end, Leave(&child)
// moves this Iter past it.
func (it *Iter) Enter() Iter {
	if it.depth >= MaxDepth && it.strict {
		return Iter{end: -1}
	}
	return Iter{b: it.b, i: it.i + 1, depth: it.depth + 1, array: it.b[it.i] == '[', strict: it.strict}
}

// Leave moves the Iter past the value that child walked, and reports
// false (ending this walk too) when child found it malformed or was not
// walked to its end.
func (it *Iter) Leave(child *Iter) bool {
	if child.b != nil || child.end < 0 {
		return it.done(-1)
	}
	it.i = child.end
	return true
}

// End returns, once NextKey or NextElem reported false, the index after
// the closing bracket, or -1 when the walk stopped at malformed input.
func (it *Iter) End() int {
	if it.b != nil {
		return -1
	}
	return it.end
}

// KeyIs reports whether the raw (still escaped) JSON string content raw
// decodes to the ASCII string want, without allocating. An escape is
// longer than the byte it stands for, so a raw key no longer than want
// matches only verbatim; otherwise decoding stops at the first difference.
func KeyIs(raw []byte, want string) bool {
	if len(raw) <= len(want) {
		return string(raw) == want
	}
	j := 0
	for i := 0; i < len(raw); {
		if j >= len(want) {
			return false
		}
		c := raw[i]
		if c != '\\' {
			if c != want[j] {
				return false
			}
			i++
			j++
			continue
		}
		if i+1 >= len(raw) {
			return false
		}
		switch e := raw[i+1]; e {
		case '"', '\\', '/':
			c = e
		case 'b':
			c = '\b'
		case 'f':
			c = '\f'
		case 'n':
			c = '\n'
		case 'r':
			c = '\r'
		case 't':
			c = '\t'
		case 'u':
			if i+6 > len(raw) {
				return false
			}
			r, ok := hex4(raw[i+2 : i+6])
			// want is ASCII, so a non-ASCII escape never matches.
			if !ok || r >= utf8.RuneSelf || byte(r) != want[j] {
				return false
			}
			i += 6
			j++
			continue
		default:
			return false
		}
		if c != want[j] {
			return false
		}
		i += 2
		j++
	}
	return j == len(want)
}

// hex4 decodes the four hex digits of a \uXXXX escape.
func hex4(h []byte) (rune, bool) {
	var r rune
	for _, c := range h {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, false
		}
		r = r<<4 | rune(c)
	}
	return r, true
}

// String decodes the JSON string literal q (quotes included) as
// encoding/json does (invalid UTF-8 and lone surrogates become U+FFFD). A
// literal without escapes whose bytes are valid UTF-8 is copied as it is;
// only the others go through encoding/json. A q that is not a valid
// literal yields "".
func String(q []byte) string {
	if len(q) < 2 || q[0] != '"' {
		return ""
	}
	in := q[1 : len(q)-1]
	if bytes.IndexByte(in, '\\') < 0 && utf8.Valid(in) {
		return string(in)
	}
	var s string
	_ = json.Unmarshal(q, &s)
	return s
}

// RuneCount returns the number of code points of the decoded value of the
// valid JSON string literal q (quotes included): an escape is one code
// point (a surrogate pair one), and each byte of invalid UTF-8 is one (it
// decodes to U+FFFD), as utf8.RuneCountInString of String(q).
func RuneCount(q []byte) int {
	n := 0
	b := q[1 : len(q)-1]
	for i := 0; i < len(b); {
		c := b[i]
		switch {
		case c == '\\':
			if b[i+1] == 'u' && i+12 <= len(b) && isSurrogate(b[i+2:i+6], "89abAB") &&
				b[i+6] == '\\' && b[i+7] == 'u' && isSurrogate(b[i+8:i+12], "cdefCDEF") {
				i += 12
			} else if b[i+1] == 'u' {
				i += 6
			} else {
				i += 2
			}
		case c < utf8.RuneSelf:
			i++
		default:
			_, size := utf8.DecodeRune(b[i:])
			i += size
		}
		n++
	}
	return n
}

// isSurrogate tests the four hex digits of a \u escape for U+D800–DBFF
// (second digit in "89abAB") or U+DC00–DFFF ("cdefCDEF").
func isSurrogate(h []byte, second string) bool {
	return (h[0] == 'd' || h[0] == 'D') && bytes.IndexByte([]byte(second), h[1]) >= 0
}

// Count returns the value of a JSON number written as 1 to 18 decimal
// digits, and 0 for anything else (negative, fractional, exponent,
// string): a token count as servers write it.
func Count(v []byte) int {
	if len(v) == 0 || len(v) > 18 {
		return 0
	}
	n := 0
	for _, c := range v {
		if c < '0' || c > '9' {
			return 0
		}
		n = n*10 + int(c-'0')
	}
	return n
}

// AppendString appends s to dst as a JSON string literal and returns the
// extended slice. Control characters are escaped so that an SSE data line
// stays one line; U+2028 and U+2029 are escaped for JavaScript clients, as
// encoding/json does; invalid UTF-8 becomes U+FFFD.
func AppendString(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
			i++
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			dst = append(dst, s[start:i]...)
			dst = append(dst, '\\', 'u', '2', '0', '2', hex[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}
