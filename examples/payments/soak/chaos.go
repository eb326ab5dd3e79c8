package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"syscall"
	"time"
)

// kinds are the faults the chaos injects, in the order in which the tail's
// breakdown ranks causes: an attempt that met a kill and latency counts
// under kill.
var kinds = []string{"kill", "sigstop", "partition", "timeout", "reset", "limit_data", "latency"}

// interval is one fault on one slot; to is zero while it lasts.
type interval struct {
	kind     int // index in kinds
	from, to time.Time
}

// timeline is every fault injected, by slot, so that each client attempt
// can be told what its instance was suffering.
type timeline struct {
	mu     sync.Mutex
	bySlot [][]interval
	counts []int // by kind
}

func newTimeline(slots int) *timeline {
	return &timeline{bySlot: make([][]interval, slots), counts: make([]int, len(kinds))}
}

// begin records the start of a fault; the function it returns its end.
func (tl *timeline) begin(slot, kind int) (end func()) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.counts[kind]++
	tl.bySlot[slot] = append(tl.bySlot[slot], interval{kind: kind, from: time.Now()})
	i := len(tl.bySlot[slot]) - 1
	return func() {
		tl.mu.Lock()
		defer tl.mu.Unlock()
		tl.bySlot[slot][i].to = time.Now()
	}
}

// worst is the highest-ranked fault on slot that overlapped [from, to], or
// -1 for none.
func (tl *timeline) worst(slot int, from, to time.Time) int {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	best := -1
	for _, iv := range tl.bySlot[slot] {
		if iv.from.After(to) || !iv.to.IsZero() && iv.to.Before(from) {
			continue
		}
		if best < 0 || iv.kind < best {
			best = iv.kind
		}
	}
	return best
}

// byKind is the count of faults injected, by kind's name.
func (tl *timeline) byKind() map[string]int {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	m := make(map[string]int, len(kinds))
	for k, n := range tl.counts {
		m[kinds[k]] = n
	}
	return m
}

// fault is one drawn fault: its kind, slot, duration, and its toxics
// (JSON for Toxiproxy's AddToxicJson) for the link faults.
type fault struct {
	kind, slot int
	d          time.Duration
	toxics     []string
}

func toxic(name, typ, stream, attrs string) string {
	return fmt.Sprintf(`{"name":%q,"type":%q,"stream":%q,"attributes":{%s}}`, name, typ, stream, attrs)
}

// draw picks a fault for slot. Link faults act on the store's replies
// (downstream), so that a request the store executed may go unanswered,
// except a partition, which swallows both ways.
func draw(r *rand.Rand, slot int) fault {
	f := fault{kind: r.IntN(len(kinds)), slot: slot, d: 500*time.Millisecond + time.Duration(r.Int64N(int64(2500*time.Millisecond)))}
	switch kinds[f.kind] {
	case "partition":
		f.toxics = []string{toxic("partition_up", "timeout", "upstream", `"timeout":0`),
			toxic("partition_down", "timeout", "downstream", `"timeout":0`)}
	case "timeout":
		// Silence, then the proxy closes the connection.
		f.toxics = []string{toxic("timeout", "timeout", "downstream", `"timeout":500`)}
	case "reset":
		f.toxics = []string{toxic("reset", "reset_peer", "downstream", `"timeout":0`)}
	case "limit_data":
		f.toxics = []string{toxic("limit_data", "limit_data", "downstream", fmt.Sprintf(`"bytes":%d`, 1000+r.IntN(19000)))}
	case "latency":
		f.toxics = []string{toxic("latency", "latency", "downstream",
			fmt.Sprintf(`"latency":%d,"jitter":%d`, 50+r.IntN(450), r.IntN(50)))}
	}
	return f
}

// chaos injects a fault every 200ms-1.2s, each on a slot with none, never
// on every slot at once, until ctx is done. Every fault then ends at once:
// stopped processes continue, toxics are removed. A replacement that fails
// to start is returned as an error.
func chaos(ctx context.Context, svc *service, tl *timeline, r *rand.Rand) error {
	var (
		mu   sync.Mutex
		busy = make([]bool, len(svc.slots))
		errs []error
		wg   sync.WaitGroup
	)
	for {
		select {
		case <-ctx.Done():
			wg.Wait()
			if len(errs) > 0 {
				return errs[0]
			}
			return nil
		case <-time.After(200*time.Millisecond + time.Duration(r.Int64N(int64(time.Second)))):
		}
		slot := r.IntN(len(svc.slots))
		f := draw(r, slot)
		mu.Lock()
		n := 0
		for _, b := range busy {
			if b {
				n++
			}
		}
		free := !busy[slot] && n < len(busy)-1
		if free {
			busy[slot] = true
		}
		mu.Unlock()
		if !free {
			continue
		}
		wg.Go(func() {
			err := inject(ctx, svc.slots[slot], tl, f)
			mu.Lock()
			busy[slot] = false
			if err != nil {
				errs = append(errs, err)
			}
			mu.Unlock()
		})
	}
}

// inject applies f and undoes it after f.d, or when ctx is done.
func inject(ctx context.Context, s *slot, tl *timeline, f fault) error {
	end := tl.begin(s.id, f.kind)
	defer end()
	hold := func() {
		select {
		case <-ctx.Done():
		case <-time.After(f.d):
		}
	}
	switch kinds[f.kind] {
	case "kill":
		// The fault lasts until the replacement listens; the records the
		// dead process owned stay in flight for one lease after that.
		return s.restart()
	case "sigstop":
		p, _ := s.current()
		p.signal(syscall.SIGSTOP)
		hold()
		p.signal(syscall.SIGCONT)
		return nil
	}
	for _, t := range f.toxics {
		if _, err := s.proxy.Toxics.AddToxicJson(strings.NewReader(t)); err != nil {
			return fmt.Errorf("toxiproxy: %s: %w", t, err)
		}
	}
	hold()
	s.proxy.Toxics.ResetToxics(context.Background())
	return nil
}
