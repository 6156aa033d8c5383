package main

import (
	"fmt"
	"image/color"
	"math"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
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
	p := plot.New()
	p.Title.Text = fmt.Sprintf("Time to first token under overload, %.0f req/s (CDF)", rate)
	p.X.Label.Text = "TTFT (ms, log scale)"
	p.Y.Label.Text = "share of requests ≤ TTFT"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Y.Min, p.Y.Max = 0, 1
	p.Legend.Top = false
	p.Legend.Left = false
	p.Legend.XOffs = -vg.Points(5)
	p.Legend.YOffs = vg.Points(20)
	p.Add(plotter.NewGrid())
	lo, hi := math.Inf(1), 0.0
	drawn, other := 0, 0
	for _, ph := range phases {
		pts := cdfPoints(ph.TTFTs, 2000, 0.01)
		if len(pts) == 0 {
			continue
		}
		line, err := plotter.NewLine(pts)
		if err != nil {
			return fmt.Errorf("plot %s: %w", ph.Name, err)
		}
		line.Width = vg.Points(2)
		if c, ok := policyColors[ph.Name]; ok {
			line.Color = c
		} else {
			line.Color = fallbackColors[other%len(fallbackColors)]
			other++
		}
		p.Add(line)
		p.Legend.Add(fmt.Sprintf("%s (p99 %s)", ph.Name, fmtMS(ph.TTFT.P99)), line)
		lo, hi = math.Min(lo, pts[0].X), math.Max(hi, pts[len(pts)-1].X)
		drawn++
	}
	if drawn == 0 {
		return fmt.Errorf("plot: no TTFT samples in any phase")
	}
	p.X.Min, p.X.Max = lo/1.2, hi*1.2
	p.Legend.TextStyle.Font.Size = vg.Points(10)
	p.Legend.Padding = vg.Points(2)
	if err := p.Save(9*vg.Inch, 5*vg.Inch, path); err != nil {
		return fmt.Errorf("plot: write %s: %w", path, err)
	}
	return nil
}
