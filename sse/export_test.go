package sse

// BufCap exposes the scanner's buffer capacity so tests can assert that
// memory stays bounded.
func (s *Scanner) BufCap() int { return cap(s.buf) }
