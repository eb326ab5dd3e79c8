// Command summary prints the reliability suite's one summary from the file
// the tests appended to (see package report), and exits with status 1 if it
// shows a double execution, a lost or replaced completion, a stranded waiter
// or a history that is not linearizable, or if a suite named by -require
// left no entry (its tests were skipped, say). Entries are added up by
// suite, store and server: a Redis store's run on Valkey is a line of its
// own, and -require names a suite on a server as suite@server
// (restarts@valkey-server).
//
//	IDEMPOTENCY_REPORT=/tmp/r go test ./...
//	go run ./internal/testkit/report/summary [-require faults,soak,...] /tmp/r
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"

	"github.com/idempotency-go/idempotency/internal/testkit/report"
)

func main() {
	require := flag.String("require", "", "comma-separated `suites` that must have left an entry")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: summary [-require SUITES] REPORT-FILE")
		os.Exit(2)
	}
	f, err := os.Open(flag.Arg(0))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	defer f.Close()
	entries, err := read(f)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	ok := summarize(os.Stdout, entries)
	if missing := absent(entries, *require); len(missing) > 0 {
		fmt.Printf("FAIL: no entry from %s\n", strings.Join(missing, ", "))
		ok = false
	}
	if !ok {
		os.Exit(1)
	}
}

// absent returns the suites of the comma-separated list required that no
// entry comes from; suite@server asks for an entry of the suite from that
// server (Entry.Server).
func absent(entries []report.Entry, required string) []string {
	seen := map[string]bool{}
	for _, e := range entries {
		seen[e.Suite] = true
		if e.Server != "" {
			seen[e.Suite+"@"+e.Server] = true
		}
	}
	var missing []string
	for _, s := range strings.Split(required, ",") {
		if s != "" && !seen[s] {
			missing = append(missing, s)
		}
	}
	return missing
}

func read(r io.Reader) ([]report.Entry, error) {
	var entries []report.Entry
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		var e report.Entry
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		entries = append(entries, e)
	}
	return entries, sc.Err()
}

// group is the entries of one suite on one store, added up.
type group struct {
	suite, store string
	cases        int
	faults       map[string]int
	report.Entry
	verdicts map[string]int
}

// summarize writes the summary to w and reports whether every guarantee
// held.
func summarize(w io.Writer, entries []report.Entry) bool {
	groups := map[[2]string]*group{}
	var fuzzTargets int
	var fuzzExecs int64
	var notes []string
	for _, e := range entries {
		if e.Suite == "fuzz" {
			fuzzTargets++
			fuzzExecs += e.FuzzExecs
			continue
		}
		store := e.Store
		if e.Server != "" {
			store += " (" + e.Server + ")"
		}
		k := [2]string{e.Suite, store}
		g := groups[k]
		if g == nil {
			g = &group{suite: e.Suite, store: store, faults: map[string]int{}, verdicts: map[string]int{}}
			groups[k] = g
		}
		g.cases++
		for kind, n := range e.Faults {
			g.faults[kind] += n
		}
		g.Operations += e.Operations
		g.Duplicates += e.Duplicates
		g.DoubleExecutions += e.DoubleExecutions
		g.LostCompletions += e.LostCompletions
		g.StrandedWaiters += e.StrandedWaiters
		g.PeakHeap = max(g.PeakHeap, e.PeakHeap)
		if e.Linearizable != "" {
			g.verdicts[e.Linearizable]++
		}
		// A group's peak heap is the largest of its cases': each case's
		// own gets a line.
		if e.PeakHeap > 0 {
			notes = append(notes, fmt.Sprintf("%s/%s %s: peak heap %.1f MiB", e.Suite, store, e.Case, float64(e.PeakHeap)/(1<<20)))
		}
		if e.Notes != "" {
			notes = append(notes, fmt.Sprintf("%s/%s %s: %s", e.Suite, store, e.Case, e.Notes))
		}
	}
	keys := make([][2]string, 0, len(groups))
	for k := range groups {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i][0] != keys[j][0] {
			return keys[i][0] < keys[j][0]
		}
		return keys[i][1] < keys[j][1]
	})

	ok := true
	var double, lost, stranded, histories int
	fmt.Fprintln(w, "reliability summary")
	width := len("store")
	for k := range groups {
		width = max(width, len(k[1]))
	}
	fmt.Fprintf(w, "%-13s %-*s %5s %10s %10s %6s %5s %8s  %s\n",
		"suite", width, "store", "cases", "operations", "duplicates", "double", "lost", "stranded", "faults / verdicts / peak heap")
	for _, k := range keys {
		g := groups[k]
		var extra []string
		if len(g.faults) > 0 {
			extra = append(extra, "faults "+counts(g.faults))
		}
		if len(g.verdicts) > 0 {
			extra = append(extra, "linearizable "+counts(g.verdicts))
			for v, n := range g.verdicts {
				histories += n
				if v != "Ok" {
					ok = false
				}
			}
		}
		if g.PeakHeap > 0 {
			extra = append(extra, fmt.Sprintf("peak heap %.1f MiB", float64(g.PeakHeap)/(1<<20)))
		}
		fmt.Fprintf(w, "%-13s %-*s %5d %10d %10d %6d %5d %8d  %s\n",
			g.suite, width, g.store, g.cases, g.Operations, g.Duplicates,
			g.DoubleExecutions, g.LostCompletions, g.StrandedWaiters, strings.Join(extra, "; "))
		double += g.DoubleExecutions
		lost += g.LostCompletions
		stranded += g.StrandedWaiters
	}
	fmt.Fprintf(w, "fuzz: %d targets, %d executions\n", fuzzTargets, fuzzExecs)
	for _, n := range notes {
		fmt.Fprintln(w, "note:", n)
	}
	if double+lost+stranded > 0 {
		ok = false
	}
	verdict := "PASS"
	if !ok {
		verdict = "FAIL"
	}
	fmt.Fprintf(w, "%s: %d double executions, %d lost or replaced completions, %d stranded waiters, %d histories checked\n",
		verdict, double, lost, stranded, histories)
	return ok
}

// counts spells a count by kind, kinds in order: "kill 3, reset 12".
func counts(m map[string]int) string {
	kinds := make([]string, 0, len(m))
	for k := range m {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	parts := make([]string, len(kinds))
	for i, k := range kinds {
		parts[i] = fmt.Sprintf("%s %d", k, m[k])
	}
	return strings.Join(parts, ", ")
}
