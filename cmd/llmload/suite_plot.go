package main

import (
	"fmt"
	"image/color"
	"path/filepath"
	"time"

	"github.com/dustin/go-humanize"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// suiteColors are the targets' colors in every suite plot.
var suiteColors = map[string]color.Color{
	TargetDirect:          color.RGBA{R: 0x66, G: 0x66, B: 0x66, A: 0xff},
	TargetLLMProxy:        color.RGBA{R: 0xd9, G: 0x5f, B: 0x02, A: 0xff},
	TargetLLMProxyTenants: color.RGBA{R: 0xe7, G: 0x29, B: 0x8a, A: 0xff},
	TargetReverseProxy:    color.RGBA{R: 0x75, G: 0x70, B: 0xb3, A: 0xff},
	TargetNginx:           color.RGBA{R: 0x1b, G: 0x9e, B: 0x77, A: 0xff},
}

// plotSuite writes the suite's PNGs into dir and returns their file names
// by kind: ttft-<streams> (S3 TTFT CDFs), rss, cpu, amp. A plot without
// data is not written.
func plotSuite(dir string, run *suiteRun) (map[string]string, error) {
	out := map[string]string{}
	if run.S3 != nil {
		for _, l := range run.S3.Levels {
			if l.Run > 1 {
				continue // one CDF per level: its first run's
			}
			var lines []cdfLine
			for _, t := range l.Targets {
				ds := make([]time.Duration, len(t.TTFTSamples))
				for i, v := range t.TTFTSamples {
					ds[i] = time.Duration(v * float64(time.Millisecond))
				}
				lines = append(lines, cdfLine{Name: t.Name, P99: t.TTFT.P99, TTFTs: ds, Color: suiteColors[t.Name],
					Dashed: t.Name == TargetDirect})
			}
			name := fmt.Sprintf("suite-ttft-cdf-%d.png", l.Streams)
			title := fmt.Sprintf("S3: time to first token, %d concurrent streams (CDF)", l.Streams)
			if err := plotCDFs(filepath.Join(dir, name), title, "target", lines); err != nil {
				return nil, err
			}
			out[fmt.Sprintf("ttft-%d", l.Streams)] = name
		}
	}
	if run.S4 != nil {
		if ok, err := plotRSS(filepath.Join(dir, "suite-rss-per-stream.png"), run.S4); err != nil {
			return nil, err
		} else if ok {
			out["rss"] = "suite-rss-per-stream.png"
		}
	}
	if ok, err := plotCPU(filepath.Join(dir, "suite-cpu-per-event.png"), run.S4, run.S4b); err != nil {
		return nil, err
	} else if ok {
		out["cpu"] = "suite-cpu-per-event.png"
	}
	if run.S6 != nil {
		if ok, err := plotAmplification(filepath.Join(dir, "suite-amplification.png"), run.S6); err != nil {
			return nil, err
		} else if ok {
			out["amp"] = "suite-amplification.png"
		}
	}
	return out, nil
}

func styledLine(pts plotter.XYs, name string) (*plotter.Line, *plotter.Scatter, error) {
	l, s, err := plotter.NewLinePoints(pts)
	if err != nil {
		return nil, nil, fmt.Errorf("plot %s: %w", name, err)
	}
	l.Width = vg.Points(2)
	if c := suiteColors[name]; c != nil {
		l.Color, s.Color = c, c
	}
	return l, s, nil
}

func plotRSS(path string, r *StreamsReport) (bool, error) {
	p := plot.New()
	p.Title.Text = "S4: proxy RSS per open stream"
	p.X.Label.Text = "concurrent streams"
	p.Y.Label.Text = "RSS per stream (KB)"
	p.Y.Min = 0
	p.Add(plotter.NewGrid())
	drawn := 0
	for _, t := range r.Targets {
		if len(t.PIDs) == 0 {
			continue
		}
		var pts plotter.XYs
		for _, l := range t.Levels {
			if l.Skipped == "" && l.Open > 0 {
				pts = append(pts, plotter.XY{X: float64(l.Streams), Y: l.RSSPerStreamKB})
			}
		}
		if len(pts) == 0 {
			continue
		}
		l, s, err := styledLine(pts, t.Name)
		if err != nil {
			return false, err
		}
		p.Add(l, s)
		p.Legend.Add(t.Name, l, s)
		drawn++
	}
	if drawn == 0 {
		return false, nil
	}
	p.Legend.Top = true
	return true, p.Save(8*vg.Inch, 4.5*vg.Inch, path)
}

func plotCPU(path string, s4, s4b *StreamsReport) (bool, error) {
	type group struct {
		label string
		r     *StreamsReport
		level int
	}
	var groups []group
	for _, sc := range []struct {
		name string
		r    *StreamsReport
	}{{"S4", s4}, {"S4b", s4b}} {
		if sc.r == nil {
			continue
		}
		for _, lv := range sc.r.Levels {
			groups = append(groups, group{fmt.Sprintf("%s, %s streams", sc.name, humanize.Comma(int64(lv))), sc.r, lv})
		}
	}
	if len(groups) == 0 {
		return false, nil
	}
	p := plot.New()
	p.Title.Text = "Proxy CPU per relayed event (S4: 1 event/s per stream, S4b: 50 events/s)"
	p.Y.Label.Text = "CPU per event (µs)"
	p.Add(plotter.NewGrid())
	names := []string{TargetLLMProxy, TargetReverseProxy, TargetNginx}
	w := vg.Points(18)
	drawn, top := 0, 0.0
	for i, name := range names {
		vals := make(plotter.Values, len(groups))
		any := false
		for j, g := range groups {
			if _, l := g.r.cell(name, g.level); l != nil && l.Skipped == "" {
				vals[j] = l.CPUPerEventUS
				top = max(top, l.CPUPerEventUS)
				any = any || l.Events > 0
			}
		}
		if !any {
			continue
		}
		bars, err := plotter.NewBarChart(vals, w)
		if err != nil {
			return false, fmt.Errorf("plot cpu %s: %w", name, err)
		}
		bars.Color = suiteColors[name]
		bars.LineStyle.Width = 0
		bars.Offset = w * vg.Length(i-1)
		p.Add(bars)
		p.Legend.Add(name, bars)
		drawn++
	}
	if drawn == 0 {
		return false, nil
	}
	labels := make([]string, len(groups))
	for i, g := range groups {
		labels[i] = g.label
	}
	p.NominalX(labels...)
	// Room above the bars for the legend.
	p.Y.Min, p.Y.Max = 0, top*1.3
	p.Legend.Top = true
	return true, p.Save(8*vg.Inch, 4.5*vg.Inch, path)
}

func plotAmplification(path string, r *StormReport) (bool, error) {
	p := plot.New()
	p.Title.Text = "S6 retry storm: upstream attempts per client request"
	p.X.Label.Text = "error rate of each upstream attempt (%)"
	p.Y.Label.Text = "attempts per request"
	p.Y.Min = 0
	p.Add(plotter.NewGrid())
	drawn := 0
	for _, t := range r.Targets {
		var pts plotter.XYs
		for _, pt := range t.Points {
			pts = append(pts, plotter.XY{X: 100 * pt.Rate, Y: pt.PerRequest})
		}
		if len(pts) == 0 {
			continue
		}
		l, s, err := styledLine(pts, t.Name)
		if err != nil {
			return false, err
		}
		if t.Name == TargetDirect {
			l.Dashes = plotutil.Dashes(1)
		}
		p.Add(l, s)
		p.Legend.Add(t.Name, l, s)
		drawn++
	}
	if drawn == 0 {
		return false, nil
	}
	p.Legend.Top, p.Legend.Left = true, true
	return true, p.Save(8*vg.Inch, 4.5*vg.Inch, path)
}
