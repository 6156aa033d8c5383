package sse

// BufCap exposes the scanner's buffer capacity so tests can assert that
// memory stays bounded.
func (s *Scanner) BufCap() int { return cap(s.buf) }

// InspectChunkWalk is InspectChunk without its plain-chunk shortcut: the
// JSON walk alone, which the shortcut must agree with on every input.
func InspectChunkWalk(data []byte) ChunkInfo {
	info, choices := inspectChunk(data)
	info.UsageOnly = info.Usage && choices == 0
	return info
}
