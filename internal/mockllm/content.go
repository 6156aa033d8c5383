package mockllm

import (
	"hash/fnv"
	"strings"
	"unicode/utf8"
)

// Token vocabularies. Odd tokens come from wideWords so that every other
// token carries multi-byte UTF-8 (2, 3 and 4-byte sequences).
var (
	plainWords = []string{" the", " quick", " mock", " token", " stream", " llama", " data", " gateway", " fleet", " reply"}
	wideWords  = []string{" café", " 日本", " 🙂", " naïve", " über", " 中文", " résumé", " 👍🏽", " Ωmega", " smörgåsbord", " 日本語", " 🚀"}
)

// padding is cycled to pad tokens to Behavior.TokenBytes.
const padding = "·é日本🙂x"

// contentSeed derives the content seed of a request from its prompt (the
// raw JSON of messages or prompt), so that the same prompt gets the same
// text on every replica, streamed or not.
func contentSeed(prompt []byte) uint64 {
	h := fnv.New64a()
	h.Write(prompt)
	return h.Sum64()
}

// tokenText is token i of the completion with the given seed, padded to
// about size bytes (never more) when size exceeds its natural length.
func tokenText(seed uint64, i, size int) string {
	words := plainWords
	if i%2 == 1 {
		words = wideWords
	}
	w := words[(seed+uint64(i)*7919)%uint64(len(words))]
	if i == 0 {
		w = strings.TrimPrefix(w, " ")
	}
	if len(w) >= size {
		return w
	}
	var b strings.Builder
	b.Grow(size)
	b.WriteString(w)
	for b.Len() < size {
		for _, r := range padding {
			if b.Len()+utf8.RuneLen(r) > size {
				return b.String()
			}
			b.WriteRune(r)
		}
	}
	return b.String()
}

// completionText is the whole text of n tokens, as a non-streaming
// response carries it.
func completionText(seed uint64, n, size int) string {
	var b strings.Builder
	for i := range n {
		b.WriteString(tokenText(seed, i, size))
	}
	return b.String()
}

// promptTokens estimates the prompt length in tokens: one per four bytes
// of the JSON prompt or messages, at least one.
func promptTokens(raw []byte) int {
	return max(1, (len(raw)+3)/4)
}
