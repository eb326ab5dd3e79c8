package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"text/tabwriter"
)

type check struct{ verdict, what, got string }

func verdict(ok bool) string {
	if ok {
		return "PASS"
	}
	return "MISS"
}

// budgets checks the library's performance budgets; a check whose inputs
// were not measured says n/a. A ratio's verdict is on the
// median of its run-by-run ratios.
func budgets(rep *report) []check {
	var checks []check
	for _, b := range []struct {
		row, floor string
		want       float64
	}{
		{at1(newOp), at1(two), 0.9},
		{newOp, two, 1},
		{at1(replayOp), at1(one), 0.95},
		{at1(httpNewOp), at1(httpTwo), 0.9},
		{httpNewOp, httpTwo, 0.9},
		{at1(pgNewOp), at1(pgTwoStatements), 0.9},
		{pgNewOp, pgTwoStatements, 0.9},
		{at1(pgReplayOp), at1(pgOneSelect), 0.8},
		{pgReplayOp, pgOneSelect, 0.8},
		{at1(pgOneCommit), at1(pgOneTx), 0.85},
		{pgOneCommit, pgOneTx, 0.85},
		{at1(pgOneReplay), at1(pgOneSelect), 0.8},
		{pgOneReplay, pgOneSelect, 0.8},
	} {
		what := fmt.Sprintf("%s ≥ %g × %s", b.row, b.want, b.floor)
		r, f := rep.row(b.row), rep.row(b.floor)
		if r == nil || f == nil {
			checks = append(checks, check{"n/a", what, "not measured"})
			continue
		}
		vs := r.ratio(f)
		got := fmt.Sprintf("%.2f ×  (%.2f–%.2f; %.0f / %.0f ops/s", vs.Median, vs.Min, vs.Max, r.ops().Median, f.ops().Median)
		// The p50s beside the verdict: ops/s follows the mean latency, which
		// a few stalls of a shared machine move far more than the median.
		if rp, fp := r.of(quantile(0.5)).Median, f.of(quantile(0.5)).Median; !math.IsNaN(rp) && !math.IsNaN(fp) {
			got += fmt.Sprintf("; p50 %.0f / %.0f µs", rp, fp)
		}
		checks = append(checks, check{verdict(vs.Median >= b.want), what, got + ")"})
	}
	const mem = "Redis memory per 200-byte record ≤ body + 200 bytes"
	if len(rep.memory) > 0 {
		m := rep.memory[0]
		checks = append(checks, check{verdict(m.Overhead() <= 200), mem, fmt.Sprintf("body + %d bytes", m.Overhead())})
	} else {
		checks = append(checks, check{"n/a", mem, rep.memSkip})
	}
	return checks
}

// clientCosts compares the heap allocations of the library's rows with
// those of their floors.
func clientCosts(rep *report) []string {
	var lines []string
	for _, p := range [][2]string{{newOp, two}, {replayOp, one}, {httpNewOp, httpTwo}} {
		r, f := rep.row(p[0]), rep.row(p[1])
		if r == nil || f == nil {
			lines = append(lines, fmt.Sprintf("%s against %s: not measured", p[0], p[1]))
			continue
		}
		a, b := r.of(allocs).Median, f.of(allocs).Median
		lines = append(lines, fmt.Sprintf("%-26s %5.1f allocs/op, %s %5.1f (%+.1f)", p[0], a, p[1], b, a-b))
	}
	return lines
}

// writeCommands prints, for each library row beside its floor, what
// redis-server ran per operation.
func writeCommands(w io.Writer, rep *report) {
	fmt.Fprintf(w, "\nRedis per operation, each library row beside its floor (medians of %d runs, each read at both ends of its measuring window):\n"+
		"  round trips: the requests this process sent (a command, or a pipeline of them) / ops\n"+
		"  calls/op, µs/op: INFO commandstats, Δcalls / ops and Δusec / ops; evalsha's µs include those of the commands\n"+
		"  its script calls, which are counted under their own names too; commands under 0.005 calls/op are left out here, not in -json\n", rep.runs)
	printed := false
	for _, p := range [][2]string{{newOp, two}, {replayOp, one}, {at1(newOp), at1(two)}, {at1(replayOp), at1(one)}} {
		r, f := rep.row(p[0]), rep.row(p[1])
		if r == nil || f == nil {
			continue
		}
		rc, fc := r.commands(), f.commands()
		if rc == nil || fc == nil {
			continue
		}
		printed = true
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintf(tw, "  \t%s\t\t%s\t\t\n", p[0], p[1])
		fmt.Fprintf(tw, "    command\tcalls/op\tµs/op\tcalls/op\tµs/op\t\n")
		fmt.Fprintf(tw, "    round trips\t%.2f\t-\t%.2f\t-\t\n", r.of(roundTrips).Median, f.of(roundTrips).Median)
		for _, name := range commandNames(rc, fc) {
			// Such as a connection's handshake (hello) in the window.
			if rc[name].Calls < 0.005 && fc[name].Calls < 0.005 {
				continue
			}
			fmt.Fprintf(tw, "    %s\t%s\t%s\t\n", name, perOpCells(rc, name), perOpCells(fc, name))
		}
		tw.Flush()
	}
	if !printed {
		fmt.Fprintln(w, "  not measured: needs INFO commandstats on one redis-server, and the rows above")
	}
}

// commandNames lists the commands of every map, evalsha first, the others
// by name.
func commandNames(ms ...map[string]perOp) []string {
	var names []string
	for _, m := range ms {
		for name := range m {
			if !slices.Contains(names, name) {
				names = append(names, name)
			}
		}
	}
	slices.SortFunc(names, func(a, b string) int {
		if (a == "evalsha") != (b == "evalsha") {
			if a == "evalsha" {
				return -1
			}
			return 1
		}
		return strings.Compare(a, b)
	})
	return names
}

func perOpCells(m map[string]perOp, name string) string {
	c, ok := m[name]
	if !ok {
		return "-\t-"
	}
	return fmt.Sprintf("%.2f\t%.2f", c.Calls, c.Usec)
}
