package main

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/idempotency-go/idempotency/internal/testkit/report"
)

// summary is what the soak did and what the audit found.
type summary struct {
	cfg     config
	elapsed time.Duration
	senders []*sender
	faults  map[string]int
	tl      *timeline
	logs    string // the instances' logs, kept when something is wrong

	replays           int // keys sent again by the audit
	charges           int // the gateway's
	inFlight, indexed int
	double            int // charges made more than once at the gateway
	lost              int // answers lost or replaced, charges missing
	unanswered        int // clients that ended with no 201
	problems          []string
}

func (s *summary) violations() int {
	return s.double + s.lost + s.unanswered + s.inFlight + s.indexed
}

// timed is one client's time to its final answer, with what slowed it.
type timed struct {
	d        time.Duration
	cause    string // the worst fault the charge's attempts met
	slowest  string // how its longest attempt ended
	attempts int
}

// times are the final-answer times of every client but the re-senders of
// old keys, whose answers are replays: for each, the worst fault any
// attempt at its charge met (a twin's kill delays both twins) and its
// longest attempt's outcome.
func (s *summary) times() []timed {
	worst := map[string]int{}
	for _, c := range s.senders {
		if c.resend {
			continue
		}
		w, ok := worst[c.key]
		if !ok {
			w = len(kinds)
		}
		for _, a := range c.attempts {
			if k := s.tl.worst(a.slot, a.from, a.from.Add(a.d)); k >= 0 && k < w {
				w = k
			}
		}
		worst[c.key] = w
	}
	var ts []timed
	for _, c := range s.senders {
		if c.resend || len(c.attempts) == 0 {
			continue
		}
		t := timed{d: c.d, cause: "none", attempts: len(c.attempts)}
		if w := worst[c.key]; w < len(kinds) {
			t.cause = kinds[w]
		}
		t.slowest = slices.MaxFunc(c.attempts, func(a, b attempt) int { return cmp.Compare(a.d, b.d) }).outcome()
		ts = append(ts, t)
	}
	slices.SortFunc(ts, func(a, b timed) int { return cmp.Compare(a.d, b.d) })
	return ts
}

// quantile is the q-quantile of ts, sorted by d (nearest rank).
func quantile(ts []timed, q float64) time.Duration {
	if len(ts) == 0 {
		return 0
	}
	return ts[min(len(ts)-1, int(q*float64(len(ts))))].d
}

func quantiles(ts []timed) string {
	if len(ts) == 0 {
		return "none"
	}
	r := func(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
	return fmt.Sprintf("p50 %v p90 %v p99 %v max %v", r(quantile(ts, .5)), r(quantile(ts, .9)),
		r(quantile(ts, .99)), r(ts[len(ts)-1].d))
}

func (s *summary) counts() (operations, duplicates, retries int) {
	for _, c := range s.senders {
		if c.duplicate {
			duplicates++
		} else {
			operations++
		}
		retries += max(0, len(c.attempts)-1)
	}
	return operations, duplicates, retries
}

func (s *summary) print(w io.Writer) {
	ops, dups, retries := s.counts()
	fmt.Fprintf(w, "soak: %s, %v (seed %d), %d instances, %d clients; lease %v, sweep %v, wait %v, work %v\n",
		s.cfg.store, s.elapsed.Round(time.Second), s.cfg.seed, s.cfg.instances, s.cfg.clients, s.cfg.lease,
		s.cfg.sweep, s.cfg.wait, s.cfg.work)
	fmt.Fprintf(w, "  operations %d, duplicates %d (concurrent twins and re-sends), retries %d, gateway charges %d, replays checked %d\n",
		ops, dups, retries, s.charges, s.replays)
	fmt.Fprint(w, "  faults:")
	for _, k := range kinds {
		fmt.Fprintf(w, " %s %d", k, s.faults[k])
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "  double charges %d, lost or replaced completions %d, stranded or unanswered clients %d, records left in flight %d (index entries %d)\n",
		s.double, s.lost, s.unanswered, s.inFlight, s.indexed)
	ts := s.times()
	fmt.Fprintf(w, "  time to a client's final answer (%d clients): %s\n", len(ts), quantiles(ts))
	fmt.Fprintln(w, "  by the worst fault its charge met:")
	for _, cause := range append(slices.Clone(kinds), "none") {
		var of []timed
		for _, t := range ts {
			if t.cause == cause {
				of = append(of, t)
			}
		}
		if len(of) > 0 {
			fmt.Fprintf(w, "    %-10s %5d  %s\n", cause, len(of), quantiles(of))
		}
	}
	if len(ts) > 0 {
		p99 := quantile(ts, .99)
		type group struct{ cause, slowest string }
		n := map[group]int{}
		longest := map[group]time.Duration{}
		attempts := map[group]int{}
		for _, t := range ts {
			if t.d < p99 {
				continue
			}
			g := group{t.cause, t.slowest}
			n[g]++
			longest[g] = max(longest[g], t.d)
			attempts[g] += t.attempts
		}
		groups := slices.Collect(func(yield func(group) bool) {
			for g := range n {
				if !yield(g) {
					return
				}
			}
		})
		slices.SortFunc(groups, func(a, b group) int { return cmp.Compare(n[b], n[a]) })
		fmt.Fprintf(w, "  the slowest 1%% (≥ %v), by cause and how the client's longest attempt ended:\n", p99.Round(time.Millisecond))
		for _, g := range groups {
			fmt.Fprintf(w, "    %-10s %-18s %4d  max %v, %.1f attempts each\n", g.cause, g.slowest, n[g],
				longest[g].Round(time.Millisecond), float64(attempts[g])/float64(n[g]))
		}
	}
	for i, p := range s.problems {
		if i == 20 {
			fmt.Fprintf(w, "  ... and %d more\n", len(s.problems)-i)
			break
		}
		fmt.Fprintf(w, "  VIOLATION: %s\n", p)
	}
	if s.logs != "" {
		fmt.Fprintf(w, "  the instances' logs: %s\n", s.logs)
	}
}

// entry is the summary as one line of the suite's report.
func (s *summary) entry() report.Entry {
	ops, dups, _ := s.counts()
	faults := map[string]int{}
	for k, n := range s.faults {
		if n > 0 {
			faults[k] = n
		}
	}
	return report.Entry{
		Suite: "soak", Store: s.cfg.store,
		Case:   fmt.Sprintf("%d instances, %v, seed %d", s.cfg.instances, s.cfg.duration, s.cfg.seed),
		Faults: faults, Operations: ops, Duplicates: dups,
		DoubleExecutions: s.double, LostCompletions: s.lost, StrandedWaiters: s.unanswered,
		Notes: fmt.Sprintf("time to final answer %s; records left in flight %d", quantiles(s.times()), s.inFlight+s.indexed),
	}
}
