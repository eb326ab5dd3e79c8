package main

import (
	"math"
	"slices"
)

// summary is a row over all its runs.
type summary struct {
	Name        string
	Baseline    string // the row it is compared with, if any
	Concurrency int
	Footnote    string
	Skipped     string    // why the row did not run
	Runs        []*result // in the order they ran
}

// spread is the median of some figures and their range.
type spread struct{ Median, Min, Max float64 }

// spreadOf returns the median, minimum and maximum of vs, leaving NaNs
// (figures not known) out; all NaN when nothing is left.
func spreadOf(vs []float64) spread {
	vs = slices.DeleteFunc(slices.Clone(vs), math.IsNaN)
	if len(vs) == 0 {
		return spread{math.NaN(), math.NaN(), math.NaN()}
	}
	slices.Sort(vs)
	m := vs[len(vs)/2]
	if len(vs)%2 == 0 {
		m = (vs[len(vs)/2-1] + m) / 2
	}
	return spread{m, vs[0], vs[len(vs)-1]}
}

// of returns the spread of one figure over the runs.
func (s *summary) of(figure func(*result) float64) spread {
	vs := make([]float64, len(s.Runs))
	for i, r := range s.Runs {
		vs[i] = figure(r)
	}
	return spreadOf(vs)
}

func (s *summary) ops() spread { return s.of((*result).OpsPerSec) }

// ratio returns the spread of s's throughput over b's, run by run: each run
// of s against the run of b measured close to it, so that what drifts
// between runs moves both.
func (s *summary) ratio(b *summary) spread {
	n := min(len(s.Runs), len(b.Runs))
	vs := make([]float64, n)
	for i := range n {
		vs[i] = math.NaN()
		if d := b.Runs[i].OpsPerSec(); d > 0 {
			vs[i] = s.Runs[i].OpsPerSec() / d
		}
	}
	return spreadOf(vs)
}

// commands returns, by command, the median calls and µs per operation over
// the runs that know them; nil when none does.
func (s *summary) commands() map[string]perOp {
	names := map[string]bool{}
	for _, r := range s.Runs {
		for name := range r.Commands {
			names[name] = true
		}
	}
	if len(names) == 0 {
		return nil
	}
	med := map[string]perOp{}
	for name := range names {
		// A run that knows commands but not this one made no such call.
		figure := func(f func(perOp) float64) float64 {
			return s.of(func(r *result) float64 {
				if r.Commands == nil {
					return math.NaN()
				}
				return f(r.Commands[name])
			}).Median
		}
		med[name] = perOp{figure(func(p perOp) float64 { return p.Calls }), figure(func(p perOp) float64 { return p.Usec })}
	}
	return med
}

// errors returns the failed operations of every run, and the first failure.
func (s *summary) errors() (n uint64, first error) {
	for _, r := range s.Runs {
		n += r.Errors
		if first == nil {
			first = r.FirstErr
		}
	}
	return n, first
}

// measured reports whether s ran and did something in every run.
func (s *summary) measured() bool {
	if s == nil || s.Skipped != "" || len(s.Runs) == 0 {
		return false
	}
	for _, r := range s.Runs {
		if r.Ops == 0 {
			return false
		}
	}
	return true
}

// interleave calls f for run 1 of every row, then run 2 of every row, and
// so on, so that the runs of a row and of its baseline alternate instead of
// one row's runs all coming before the other's: what drifts over the
// program's time (another process starting, the machine's clock speed)
// then moves both. It stops at f's first error.
func interleave(rows, runs int, f func(row, run int) error) error {
	for run := range runs {
		for row := range rows {
			if err := f(row, run); err != nil {
				return err
			}
		}
	}
	return nil
}
