package statusview

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// gap is the space between two columns.
const gap = "  "

// column is one column of a table.
type column struct {
	head string
	// max is the widest the column gets (cells are cut to it); the last
	// column of a table takes what is left of the line instead.
	max int
	// right aligns it to the right (numbers).
	right bool
	// addr cuts long cells in the middle, keeping the port (":8000").
	addr bool
}

// table is a header and rows of cells, one per column.
type table struct {
	cols []column
	rows [][]string
}

func (t *table) add(cells ...string) { t.rows = append(t.rows, cells) }

// write writes the table, no line wider than width (in runes): each
// column as wide as its widest cell or header up to its max, the last one
// cut to what is left (on a line too narrow for that, the widest columns
// are cut further, down to their headers). It returns the columns' widths.
func (t *table) write(b *strings.Builder, width int) []int {
	w := make([]int, len(t.cols))
	used := 0
	for i, c := range t.cols {
		w[i] = runes(c.head)
		for _, r := range t.rows {
			w[i] = max(w[i], runes(r[i]))
		}
		if i < len(t.cols)-1 {
			w[i] = min(w[i], max(c.max, runes(c.head)))
			used += w[i] + len(gap)
		}
	}
	last := len(t.cols) - 1
	// On a narrow line, the widest columns give way (down to their
	// header) until the last one has room for its header.
	for used+runes(t.cols[last].head) > width {
		widest := -1
		for i := range last {
			if w[i] > runes(t.cols[i].head) && (widest < 0 || w[i] > w[widest]) {
				widest = i
			}
		}
		if widest < 0 {
			break
		}
		w[widest]--
		used--
	}
	w[last] = max(min(w[last], width-used), 0)
	line := func(cells []string) {
		var l strings.Builder
		for i, c := range t.cols {
			cell := cut(cells[i], w[i], c.addr)
			pad := strings.Repeat(" ", w[i]-runes(cell))
			if i > 0 {
				l.WriteString(gap)
			}
			if c.right {
				l.WriteString(pad + cell)
			} else if i < last {
				l.WriteString(cell + pad)
			} else {
				l.WriteString(cell)
			}
		}
		b.WriteString(strings.TrimRight(l.String(), " "))
		b.WriteByte('\n')
	}
	heads := make([]string, len(t.cols))
	for i, c := range t.cols {
		heads[i] = c.head
	}
	line(heads)
	for _, r := range t.rows {
		line(r)
	}
	return w
}

// runes is the width of s on a terminal, one column per rune.
func runes(s string) int { return utf8.RuneCountInString(s) }

// cut shortens s to n runes, ending it with "…"; as an address (addr), it
// keeps the port and drops the middle of the host instead
// ("vllm-0.infer…cluster.local:8000").
func cut(s string, n int, addr bool) string {
	if runes(s) <= n {
		return s
	}
	if n <= 1 {
		return strings.Repeat("…", n)
	}
	r := []rune(s)
	if addr {
		tail := []rune{}
		if i := strings.LastIndexByte(s, ':'); i >= 0 {
			tail = []rune(s[i:])
		}
		if room := n - 1 - len(tail); room >= 4 {
			head := room / 2
			rest := room - head
			body := r[:len(r)-len(tail)]
			return string(body[:head]) + "…" + string(body[len(body)-rest:]) + string(tail)
		}
	}
	return string(r[:n-1]) + "…"
}

// clean makes text from the admin API one line of printable runes.
func clean(s string) string {
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) || !unicode.IsPrint(r) {
			return ' '
		}
		return r
	}, s)
}
