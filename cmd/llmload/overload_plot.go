package main

import (
	"fmt"
	"image/color"
)

// policyColors are the lines' colors by policy; other names take
// fallbackColors in order.
var (
	policyColors = map[string]color.Color{
		PolicyRoundRobin: color.RGBA{R: 0xd9, G: 0x5f, B: 0x02, A: 0xff},
		PolicyLeastConn:  color.RGBA{R: 0x75, G: 0x70, B: 0xb3, A: 0xff},
		PolicyLeastQueue: color.RGBA{R: 0x1b, G: 0x9e, B: 0x77, A: 0xff},
	}
	fallbackColors = []color.Color{
		color.RGBA{R: 0xe7, G: 0x29, B: 0x8a, A: 0xff},
		color.RGBA{R: 0x66, G: 0xa6, B: 0x1e, A: 0xff},
		color.RGBA{R: 0x66, G: 0x66, B: 0x66, A: 0xff},
	}
)

// plotOverloadCDF writes a PNG of each phase's TTFT CDF on a logarithmic
// time axis, with its p99 in the legend.
func plotOverloadCDF(path string, phases []PhaseResult, rate float64) error {
	var lines []cdfLine
	other := 0
	for _, ph := range phases {
		l := cdfLine{Name: ph.Name, P99: ph.TTFT.P99, TTFTs: ph.TTFTs}
		if c, ok := policyColors[ph.Name]; ok {
			l.Color = c
		} else if len(ph.TTFTs) > 0 {
			l.Color = fallbackColors[other%len(fallbackColors)]
			other++
		}
		lines = append(lines, l)
	}
	return plotCDFs(path, fmt.Sprintf("Time to first token under overload, %.0f req/s (CDF)", rate), "phase", lines)
}
