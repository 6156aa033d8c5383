package main

import (
	"fmt"
	"image/color"
	"math"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

// cdfPoints returns the empirical CDF of sorted durations as (ms, share)
// points: for each distinct value, the share of samples ≤ it. At most
// maxPoints points are kept (evenly by rank, the last always), so a plot of
// a million samples stays small. Values ≤ 0 are raised to floor (for a log
// axis).
func cdfPoints(sorted []time.Duration, maxPoints int, floor float64) plotter.XYs {
	n := len(sorted)
	if n == 0 {
		return nil
	}
	step := 1
	if maxPoints > 0 && n > maxPoints {
		step = int(math.Ceil(float64(n) / float64(maxPoints)))
	}
	var pts plotter.XYs
	for i := 0; i < n; i++ {
		last := i == n-1
		// The last sample of a run of equal values carries the run's share.
		if !last && sorted[i+1] == sorted[i] {
			continue
		}
		if !last && step > 1 && (i+1)%step != 0 {
			continue
		}
		x := ms(sorted[i])
		if x < floor {
			x = floor
		}
		pts = append(pts, plotter.XY{X: x, Y: float64(i+1) / float64(n)})
	}
	return pts
}

// armColors are the lines' colors, by arm.
var armColors = map[string]color.Color{
	ArmSolo:        color.RGBA{R: 0x1b, G: 0x9e, B: 0x77, A: 0xff},
	ArmNoAdmission: color.RGBA{R: 0xd9, G: 0x5f, B: 0x02, A: 0xff},
	ArmAdmission:   color.RGBA{R: 0x75, G: 0x70, B: 0xb3, A: 0xff},
}

// plotTTFTCDF writes a PNG of the victims' TTFT CDF in each arm, on a
// logarithmic time axis, with the p99 of each arm in its legend.
func plotTTFTCDF(path string, arms []ArmResult) error {
	var lines []cdfLine
	for _, a := range arms {
		l := cdfLine{Name: a.Name, P99: a.Victims.TTFT.P99, TTFTs: a.TTFTs, Color: armColors[a.Name]}
		l.Dashed = a.Name == ArmAdmission
		lines = append(lines, l)
	}
	return plotCDFs(path, "Victims' time to first token (CDF)", "arm", lines)
}

// cdfLine is one line of a TTFT CDF plot.
type cdfLine struct {
	// Name is the legend's label, shown with P99 (ms).
	Name string
	P99  float64
	// TTFTs are the samples, sorted.
	TTFTs []time.Duration
	// Color is the line's color; nil takes the plotter's default.
	Color  color.Color
	Dashed bool
}

// plotCDFs writes a 9×5 in PNG of the lines' empirical CDFs on a
// logarithmic time axis (ms), with each line's p99 in the legend; what
// names a line ("arm", "phase") is for the error when none has samples.
func plotCDFs(path, title, what string, lines []cdfLine) error {
	p := plot.New()
	p.Title.Text = title
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
	drawn := 0
	for _, l := range lines {
		pts := cdfPoints(l.TTFTs, 2000, 0.01)
		if len(pts) == 0 {
			continue
		}
		line, err := plotter.NewLine(pts)
		if err != nil {
			return fmt.Errorf("plot %s: %w", l.Name, err)
		}
		line.Width = vg.Points(2)
		if l.Color != nil {
			line.Color = l.Color
		}
		if l.Dashed {
			line.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
		}
		p.Add(line)
		p.Legend.Add(fmt.Sprintf("%s (p99 %s)", l.Name, fmtMS(l.P99)), line)
		lo, hi = math.Min(lo, pts[0].X), math.Max(hi, pts[len(pts)-1].X)
		drawn++
	}
	if drawn == 0 {
		return fmt.Errorf("plot: no TTFT samples in any %s", what)
	}
	p.X.Min, p.X.Max = lo/1.2, hi*1.2
	p.Legend.TextStyle.Font.Size = vg.Points(10)
	p.Legend.Padding = vg.Points(2)
	if err := p.Save(9*vg.Inch, 5*vg.Inch, path); err != nil {
		return fmt.Errorf("plot: write %s: %w", path, err)
	}
	return nil
}
