//go:build race

package proxy

// raceEnabled: under the race detector sync.Pool drops items at random, so
// allocation counts say nothing about the code.
const raceEnabled = true
