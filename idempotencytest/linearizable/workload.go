package linearizable

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/idempotency-go/idempotency"
)

const (
	// retention outlasts every history, so that the model can leave expiry
	// out.
	retention = time.Hour
	// callTimeout bounds each store call: one that runs out fails with
	// ErrUnavailable, and its outcome is unknown.
	callTimeout = time.Second
	minLease    = 50 * time.Millisecond
	maxLease    = 200 * time.Millisecond
)

// fingerprint is the fingerprint of one of the two requests a key is
// claimed for: mostly A, now and then B, which the record of an A must
// refuse as a mismatch, and the other way round.
func fingerprint(label byte) idempotency.Fingerprint {
	return idempotency.FingerprintOf("linearizable", []byte{label})
}

// history is what the clients of one run did.
type history struct {
	start time.Time
	skew  int64

	mu  sync.Mutex
	ops []porcupine.Operation
	// breaches are the errors outside the contract: neither ErrUnavailable
	// nor, from an owner's call, ErrFenced.
	breaches []error
}

// now reads the model's clock: this process's monotonic clock since start.
func (h *history) now() int64 { return int64(time.Since(h.start)) }

func (h *history) add(client int, in input, out output, call, ret int64) {
	in.from, in.to = call-h.skew, ret+h.skew
	if out.unknown {
		in.to, ret = never, never
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ops = append(h.ops, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
}

func (h *history) breach(in input, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.breaches = append(h.breaches, fmt.Errorf("%v: %w", in.verb, err))
}

// run has opts.Clients goroutines call store for opts.Duration, each acting
// as a Guard would, on opts.Keys records at a time, and returns what they
// did.
func run(ctx context.Context, store idempotency.Store, opts Options) *history {
	h := &history{start: time.Now(), skew: int64(opts.Skew)}
	ks := &keys{scope: "linearizable-" + rand.Text(), gen: make([]int, opts.Keys)}
	until := h.start.Add(opts.Duration)
	var wg sync.WaitGroup
	ps, _ := store.(idempotency.RecoveryPointStore)
	for id := range opts.Clients {
		c := &client{id: id, store: store, points: ps, h: h, keys: ks}
		wg.Go(func() {
			for time.Now().Before(until) && ctx.Err() == nil {
				c.visit(ctx)
			}
		})
	}
	wg.Wait()
	return h
}

// keys names the records the clients share: one per slot, replaced by a new
// one once it is completed, since a completed record only replays.
type keys struct {
	scope string
	mu    sync.Mutex
	gen   []int
}

func (ks *keys) pick() idempotency.Key {
	ks.mu.Lock()
	defer ks.mu.Unlock()
	return idempotency.Key{Scope: ks.scope, Name: ks.name(mrand.N(len(ks.gen)))}
}

// completed moves k's slot on to a new record, unless another client did.
func (ks *keys) completed(k idempotency.Key) {
	ks.mu.Lock()
	defer ks.mu.Unlock()
	for slot := range ks.gen {
		if ks.name(slot) == k.Name {
			ks.gen[slot]++
		}
	}
}

func (ks *keys) name(slot int) string { return fmt.Sprintf("r%d.%d", slot, ks.gen[slot]) }

// client is one goroutine of a run.
type client struct {
	id    int
	store idempotency.Store
	// points is store as a RecoveryPointStore, or nil when it is none.
	points idempotency.RecoveryPointStore
	h      *history
	keys   *keys
	calls  int // claims made, for operation IDs
}

// visit claims a record, and waits or works as its answer says. A claim
// for the other fingerprint now and then, and claims while the record is in
// flight, act as reads of the record.
func (c *client) visit(ctx context.Context) {
	k := c.keys.pick()
	fp := byte('A')
	if mrand.N(8) == 0 {
		fp = 'B'
	}
	lease := minLease + mrand.N(maxLease-minLease+time.Millisecond).Truncate(time.Millisecond)
	out := c.claim(ctx, k, fp, lease)
	// A waiter re-claims when the lease should run out, sometimes sooner.
	for range 3 {
		if out.state != idempotency.InFlight {
			break
		}
		sleep(ctx, mrand.N(time.Duration(out.leaseLeft)+20*time.Millisecond))
		out = c.claim(ctx, k, fp, lease)
	}
	switch {
	case out.state == idempotency.Owner:
		c.own(ctx, k, out, lease)
	case out.state == idempotency.Completed:
		c.keys.completed(k)
	}
}

// own runs the attempt that cl made its caller the owner of: renewals,
// steps when the store keeps recovery points, work, then one of the ways
// an attempt ends, including a stall past the lease after which the owner
// still tries to complete, and now and then a late call with the token
// after the attempt ended.
func (c *client) own(ctx context.Context, k idempotency.Key, cl output, lease time.Duration) {
	token, opID := cl.token, cl.opID
	for range mrand.N(3) {
		sleep(ctx, mrand.N(lease*2/3))
		if out := c.owner(ctx, heartbeat, k, token, opID, lease); out.fenced {
			return
		}
	}
	if c.points != nil && !c.steps(ctx, k, token, cl.attempt, lease) {
		return
	}
	sleep(ctx, mrand.N(lease/2))
	switch n := mrand.N(20); {
	case n < 6:
		c.owner(ctx, complete, k, token, opID, lease)
	case n < 10:
		c.owner(ctx, release, k, token, opID, lease)
	case n < 13:
		c.owner(ctx, forget, k, token, opID, lease)
	case n < 15:
		c.owner(ctx, abandon, k, token, opID, lease)
	default:
		sleep(ctx, lease/2+mrand.N(lease*3/2))
		if c.points != nil && mrand.N(2) == 0 {
			c.owner(ctx, save, k, token, opID, lease)
		}
		c.owner(ctx, complete, k, token, opID, lease)
	}
	if mrand.N(5) == 0 {
		sleep(ctx, mrand.N(lease))
		late := []verb{complete, release, heartbeat}
		if c.points != nil {
			// Half the late calls are on the points, most of them saves,
			// which a stale owner must never get through.
			late = append(late, save, save, points)
		}
		c.owner(ctx, late[mrand.N(len(late))], k, token, opID, lease)
	}
}

// stepNames are the steps of every record's operation, in their order.
var stepNames = [...]string{"order", "charge", "receipt", "publish"}

// steps saves up to two recovery points as Step would: a takeover reads
// the points first and goes on after the steps it finds; the point of the
// next step is saved, now and then twice, as a resent save is, and now and
// then a step out of order or one saved already. It reports false when
// the owner was fenced.
func (c *client) steps(ctx context.Context, k idempotency.Key, token uint64, attempt int, lease time.Duration) bool {
	next := 0
	if attempt > 1 || mrand.N(4) == 0 {
		out := c.step(ctx, points, k, token, "")
		if out.fenced {
			return false
		}
		for next < len(stepNames) && strings.Contains(out.points, strconv.Quote(stepNames[next])+"=") {
			next++
		}
	}
	for range mrand.N(3) {
		sleep(ctx, mrand.N(lease/4))
		step := stepNames[mrand.N(len(stepNames))]
		if next < len(stepNames) && mrand.N(4) > 0 {
			step = stepNames[next]
			next++
		}
		sends := 1
		if mrand.N(6) == 0 {
			sends = 2
		}
		for range sends {
			if c.step(ctx, save, k, token, step).fenced {
				return false
			}
		}
	}
	if mrand.N(3) == 0 {
		return !c.step(ctx, points, k, token, "").fenced
	}
	return true
}

// step saves the point of step with token, or reads the points.
func (c *client) step(ctx context.Context, v verb, k idempotency.Key, token uint64, step string) output {
	in := input{verb: v, key: k.Name, token: token, step: step}
	if v == save {
		// Each owner's result is its own, so that a read names the one the
		// store kept.
		in.result = fmt.Sprintf("%s by #%d", step, token)
	}
	return c.call(ctx, in, func(ctx context.Context) (output, error) {
		if v == save {
			return output{}, c.points.SaveRecoveryPoint(ctx, k, token, idempotency.RecoveryPoint{Step: step, Result: []byte(in.result)})
		}
		ps, err := c.points.RecoveryPoints(ctx, k, token)
		return output{points: pointList(ps)}, err
	})
}

func (c *client) claim(ctx context.Context, k idempotency.Key, fp byte, lease time.Duration) output {
	c.calls++
	in := input{verb: claim, key: k.Name, fp: fp, opID: fmt.Sprintf("c%d-%d", c.id, c.calls), lease: int64(lease)}
	req := idempotency.ClaimRequest{Key: k, Fingerprint: fingerprint(fp), OperationID: in.opID,
		Lease: lease, Retention: retention, Watch: mrand.N(2) == 0}
	return c.call(ctx, in, func(ctx context.Context) (output, error) {
		cl, err := c.store.Claim(ctx, req)
		return output{state: cl.State, opID: cl.OperationID, attempt: cl.Attempt, token: cl.Token,
			abandoned: cl.Abandoned, resp: describe(cl.Response), leaseLeft: int64(cl.LeaseLeft)}, err
	})
}

// owner makes one of the owner's calls, v, with token; a save is of a step
// picked at random.
func (c *client) owner(ctx context.Context, v verb, k idempotency.Key, token uint64, opID string, lease time.Duration) output {
	if v == save || v == points {
		return c.step(ctx, v, k, token, stepNames[mrand.N(len(stepNames))])
	}
	in := input{verb: v, key: k.Name, token: token}
	var resp idempotency.Response
	switch v {
	case heartbeat:
		in.lease = int64(lease)
	case complete:
		// Each completion's response is its own, so that a replay names the
		// one the store kept.
		resp = idempotency.Response{Status: 201 + mrand.N(2),
			Header: http.Header{"X-Token": {fmt.Sprint(token)}}, Body: []byte("charged by " + opID)}
		in.resp = describe(resp)
	}
	return c.call(ctx, in, func(ctx context.Context) (output, error) {
		var err error
		switch v {
		case complete:
			err = c.store.Complete(ctx, k, token, resp, retention)
		case release:
			err = c.store.Release(ctx, k, token)
		case forget:
			err = c.store.Forget(ctx, k, token)
		case heartbeat:
			err = c.store.Heartbeat(ctx, k, token, lease)
		case abandon:
			err = c.store.Abandon(ctx, k, token)
		}
		return output{}, err
	})
}

// call makes one store call, f, and records it with its answer.
func (c *client) call(ctx context.Context, in input, f func(context.Context) (output, error)) output {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	start := c.h.now()
	out, err := f(ctx)
	ret := c.h.now()
	switch {
	case err == nil:
	case errors.Is(err, idempotency.ErrFenced) && in.verb != claim:
		out = output{fenced: true}
	default:
		if !errors.Is(err, idempotency.ErrUnavailable) {
			c.h.breach(in, err)
		}
		out = output{unknown: true}
	}
	c.h.add(c.id, in, out, start, ret)
	return out
}

// describe writes a response as the model compares them.
func describe(r idempotency.Response) string {
	if r.Status == 0 {
		return ""
	}
	return fmt.Sprintf("%d %v %q", r.Status, r.Header, r.Body)
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}
