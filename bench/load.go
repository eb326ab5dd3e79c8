package main

import (
	"context"
	"math"
	"math/bits"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// subBits sets the histogram's precision: 2^subBits buckets per power of two,
// so a bucket is at most 1/64 (1.6 %) of its value wide.
const subBits = 6

// histogram counts latencies in nanoseconds: exactly below 128 ns, then in
// 64 buckets per power of two. Recording is a few instructions and never
// allocates, so measuring costs the same, next to nothing, in every row.
type histogram [64 << subBits]uint64

func bucketOf(ns uint64) int {
	if ns < 2<<subBits {
		return int(ns)
	}
	shift := bits.Len64(ns) - subBits - 1
	return (shift+1)<<subBits + int(ns>>shift) - 1<<subBits
}

// bucketMid is the middle of bucket i, the value it stands for.
func bucketMid(i int) float64 {
	if i < 2<<subBits {
		return float64(i)
	}
	shift := i>>subBits - 1
	low := uint64(i&(1<<subBits-1)+1<<subBits) << shift
	return float64(low) + float64(uint64(1)<<shift)/2
}

func (h *histogram) record(d time.Duration) { h[bucketOf(uint64(max(d, 0)))]++ }

func (h *histogram) add(o *histogram) {
	for i, n := range o {
		h[i] += n
	}
}

func (h *histogram) count() uint64 {
	var n uint64
	for _, c := range h {
		n += c
	}
	return n
}

// quantile returns the q-quantile (0 < q <= 1) in microseconds, or NaN for
// an empty histogram.
func (h *histogram) quantile(q float64) float64 {
	total := h.count()
	if total == 0 {
		return math.NaN()
	}
	rank := uint64(math.Ceil(q * float64(total)))
	var seen uint64
	for i, c := range h {
		if seen += c; seen >= rank {
			return bucketMid(i) / 1e3
		}
	}
	panic("unreachable: rank exceeds the count")
}

// timedOp is one operation of a row; it reports how long the part worth
// measuring took. w is the worker running it and i counts that worker's
// operations from 0, so (w, i) is unique within a row.
type timedOp func(ctx context.Context, w, i int) (time.Duration, error)

// timed measures the whole of f, the same way for every row.
func timed(f func(ctx context.Context, w, i int) error) timedOp {
	return func(ctx context.Context, w, i int) (time.Duration, error) {
		start := time.Now()
		err := f(ctx, w, i)
		return time.Since(start), err
	}
}

// result is what one run of one row measured.
type result struct {
	Ops       uint64
	Elapsed   time.Duration
	Latency   histogram
	Allocs    float64 // heap allocations per operation in this process
	CPU       float64 // µs of this process's CPU per operation
	ServerCPU float64 // µs of redis-server's CPU per operation; NaN if not known
	// Others is the CPU, in cores, that the other processes of the
	// machine (all but this one and redis-server) used meanwhile: the
	// noisy neighbours of a shared machine. NaN if not known.
	Others float64
	// Steal is the CPU, in cores, that the hypervisor gave other machines
	// meanwhile, while this one had work; NaN if not known.
	Steal      float64
	RoundTrips float64 // to Redis, per operation
	// Commands is, by command, the calls and µs redis-server spent per
	// operation (INFO commandstats); nil if not known.
	Commands map[string]perOp
	Errors   uint64
	FirstErr error
}

func (r *result) OpsPerSec() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Ops) / r.Elapsed.Seconds()
}

// worker is one load goroutine's tally. Each is its own allocation, larger
// than a cache line, so workers never share one.
type worker struct {
	lat   histogram
	ops   atomic.Uint64 // read by the progress reporter while running
	errs  uint64
	first error
}

// usage is what this process and the server have used so far.
type usage struct {
	self, server time.Duration // CPU time; server < 0 if not known
	// others is the CPU time of every process on the machine but this one
	// and a redis-server the bench started; < 0 if not known.
	others   time.Duration
	steal    time.Duration          // the hypervisor's (see machineCPU); < 0 if not known
	commands map[string]commandStat // INFO commandstats; nil if not known
	trips    uint64                 // round trips to Redis
}

// meter reads the usage so far.
type meter func() usage

// crew is concurrency goroutines running op until stopped, recording every
// operation that ends while measuring is set.
type crew struct {
	measuring, stop atomic.Bool
	workers         []*worker
	wg              sync.WaitGroup
}

func startCrew(ctx context.Context, concurrency int, op timedOp) *crew {
	c := &crew{workers: make([]*worker, concurrency)}
	for w := range c.workers {
		wk := &worker{}
		c.workers[w] = wk
		c.wg.Go(func() {
			for i := 0; !c.stop.Load(); i++ {
				d, err := op(ctx, w, i)
				if !c.measuring.Load() {
					continue
				}
				if err != nil {
					if wk.errs++; wk.first == nil {
						wk.first = err
					}
					continue
				}
				wk.lat.record(d)
				wk.ops.Add(1)
			}
		})
	}
	return c
}

// ops is how many operations were recorded so far.
func (c *crew) ops() uint64 {
	var n uint64
	for _, wk := range c.workers {
		n += wk.ops.Load()
	}
	return n
}

// finish stops the crew, waits for it, and sums what it recorded in a
// window of elapsed.
func (c *crew) finish(elapsed time.Duration) result {
	c.measuring.Store(false)
	c.stop.Store(true)
	c.wg.Wait()
	r := result{Elapsed: elapsed}
	for _, wk := range c.workers {
		r.Latency.add(&wk.lat)
		r.Ops += wk.ops.Load()
		r.Errors += wk.errs
		if r.FirstErr == nil {
			r.FirstErr = wk.first
		}
	}
	return r
}

// load runs op on concurrency goroutines: for warm (scripts loaded, pools
// filled, nothing recorded), then for dur, recording every operation that
// ends in that window; use is read at the window's two ends. A window in
// which no operation ended (a row slower than dur, such as one waiting for
// a disk's fsync) goes on until one does, for at most 10 s more. progress
// is called now and then with the time spent and the operations done so
// far.
func load(ctx context.Context, concurrency int, warm, dur time.Duration, op timedOp, use meter, progress func(time.Duration, uint64)) result {
	c := startCrew(ctx, concurrency, op)
	sleep(ctx, warm)

	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	u0 := use()
	c.measuring.Store(true)
	start := time.Now()
	tick := time.NewTicker(250 * time.Millisecond)
	for end := start.Add(dur); ctx.Err() == nil; {
		left := time.Until(end)
		if left <= 0 && (c.ops() > 0 || time.Since(start) > dur+maxWait) {
			break
		}
		left = max(left, time.Millisecond)
		select {
		case <-tick.C:
			progress(time.Since(start), c.ops())
		case <-time.After(left):
		case <-ctx.Done():
		}
	}
	tick.Stop()
	c.measuring.Store(false)
	elapsed := time.Since(start)
	u1 := use()
	runtime.ReadMemStats(&after)
	r := c.finish(elapsed)

	r.ServerCPU, r.Others, r.Steal = math.NaN(), math.NaN(), math.NaN()
	if u0.others >= 0 && u1.others >= 0 {
		r.Others = max(0, u1.others-u0.others).Seconds() / elapsed.Seconds()
	}
	if u0.steal >= 0 && u1.steal >= 0 {
		r.Steal = (u1.steal - u0.steal).Seconds() / elapsed.Seconds()
	}
	if r.Ops > 0 {
		r.Allocs = float64(after.Mallocs-before.Mallocs) / float64(r.Ops)
		r.CPU = float64((u1.self - u0.self).Microseconds()) / float64(r.Ops)
		if u0.server >= 0 && u1.server >= 0 {
			r.ServerCPU = float64((u1.server - u0.server).Microseconds()) / float64(r.Ops)
		}
		r.RoundTrips = float64(u1.trips-u0.trips) / float64(r.Ops)
		r.Commands = commandsPerOp(u0.commands, u1.commands, r.Ops)
	}
	return r
}

// maxWait is how much longer than its duration a window waits for its
// first operation to end.
const maxWait = 10 * time.Second

// sleep waits for d or until ctx is done.
func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}
