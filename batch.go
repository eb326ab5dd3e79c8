package idempotency

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// batcher sends the scripts of concurrent operations to Redis together.
// A call finding fewer than maxFlying sends in flight is sent at once, by
// itself, on its caller's goroutine; a call arriving while they are all in
// flight queues, and when one of them ends, every call queued meanwhile goes
// out in one pipeline, sent from a goroutine of its own. Under load most
// round trips then carry many scripts, and the system calls a round trip
// costs, on the client and on the server, are shared; an idle store sends
// each script alone, at once.
//
// Each call keeps its own command, filled in by the pipeline in order, so
// no reply can reach another call. A queued call returns when its context
// ends, sent or not: a call still in the queue leaves it unsent, and one
// whose pipeline is on its way fails with its context's error while the
// pipeline goes on. A pipeline runs until the latest deadline of its calls
// (none, if one of them has none), so that it cuts none of them short; with
// a client that honours deadlines (ContextTimeoutEnabled) every call then
// returns by its own.
type batcher struct {
	// send sends the calls of batch, one or more, and sets the replies of
	// each.
	send func(ctx context.Context, batch []*batchCall)

	mu     sync.Mutex
	queue  []*batchCall
	flying int // sends in flight: calls sent alone, and goroutines sending queued calls
}

const (
	// maxFlying bounds the sends in flight: enough to keep the client and
	// the server busy while replies come back, few enough that queues form
	// under load. (2 and 8 measured no better with go run ./bench.)
	maxFlying = 4
	// maxBatch bounds one pipeline, so that a long queue does not make one
	// send as slow as all of it.
	maxBatch = 128
)

// batchCall is one script to be sent, and its replies once sent.
type batchCall struct {
	sc   *script
	args []any
	cmd  *redis.Cmd // the script's reply
	acks *redis.Cmd // the reply of the WAIT for replicas sent after it, if any
	// the reply of the WAITAOF sent after it, if any (RedisOptions.Fsync)
	fsynced *redis.Cmd
	// A queued call's context, whose values and deadline its pipeline
	// takes, and the channel closed once the pipeline set its replies.
	ctx     context.Context
	replied chan struct{}
	self    [1]*batchCall // the call as a batch of one, without allocating one
}

// run sends sc with args (made by sc.args) and returns the call, sent, or
// failed with ctx's error when ctx ended first.
func (b *batcher) run(ctx context.Context, sc *script, args []any) *batchCall {
	c := &batchCall{sc: sc, args: args}
	b.mu.Lock()
	if b.flying < maxFlying {
		b.flying++
		b.mu.Unlock()
		// Deferred: whatever happens in send, no queued call is left waiting.
		defer b.handOff()
		c.self[0] = c
		b.send(ctx, c.self[:])
		return c
	}
	c.ctx, c.replied = ctx, make(chan struct{})
	b.queue = append(b.queue, c)
	b.mu.Unlock()
	select {
	case <-c.replied:
		return c
	case <-ctx.Done():
	}
	b.mu.Lock()
	i := slices.Index(b.queue, c)
	if i >= 0 {
		b.queue = slices.Delete(b.queue, i, i+1)
	}
	b.mu.Unlock()
	when := unsent
	if i < 0 {
		select {
		case <-c.replied:
			// The pipeline answered meanwhile: its reply stands.
			return c
		default:
			when = onItsWay
		}
	}
	// A new call: the pipeline may still write c's replies.
	return &batchCall{cmd: endedCmd(when, ctx.Err())}
}

// handOff ends a send in flight: the calls queued meanwhile, up to
// maxBatch, go out next, in the same turn, on a goroutine that sends queued
// calls for as long as calls queue; with none queued, the turn ends.
func (b *batcher) handOff() {
	if next := b.next(); next != nil {
		go b.sendQueued(next)
	}
}

// next takes the calls queued, up to maxBatch, for the turn in flight; with
// none queued, it ends the turn and returns nil.
func (b *batcher) next() []*batchCall {
	b.mu.Lock()
	defer b.mu.Unlock()
	next := b.queue[:min(len(b.queue), maxBatch)]
	b.queue = b.queue[len(next):]
	if len(next) == 0 {
		b.flying--
		return nil
	}
	return next
}

// sendQueued sends batch, a turn's queued calls, then the calls queued
// meanwhile, until none are.
func (b *batcher) sendQueued(batch []*batchCall) {
	for batch != nil {
		b.sendBatch(batch)
		batch = b.next()
	}
}

// sendBatch sends the calls of batch whose context has not ended, answers
// the others as never sent, and lets every call go. A panic in send (a
// client hook's, say) fails the batch's calls rather than the process, whose
// other calls would then never be answered.
func (b *batcher) sendBatch(batch []*batchCall) {
	live := make([]*batchCall, 0, len(batch))
	for _, c := range batch {
		if err := c.ctx.Err(); err != nil {
			c.cmd = endedCmd(unsent, err)
		} else {
			live = append(live, c)
		}
	}
	defer func() {
		p := recover()
		for _, c := range live {
			switch {
			case p != nil:
				c.cmd = failedCmd(fmt.Errorf("idempotency: the pipeline carrying this call panicked: %v", p))
			case c.cmd == nil:
				c.cmd = failedCmd(errors.New("idempotency: the pipeline carrying this call failed"))
			}
		}
		for _, c := range batch {
			close(c.replied)
		}
	}()
	if len(live) > 0 {
		ctx, cancel := batchContext(live)
		defer cancel()
		b.send(ctx, live)
	}
}

// When a call's context ended: before it was sent, nothing was applied;
// while it was on its way, the store may have applied it.
const (
	unsent   = "before it was sent"
	onItsWay = "while it was on its way"
)

// endedCmd is the reply of a call whose context ended, with err, when.
func endedCmd(when string, err error) *redis.Cmd {
	return failedCmd(fmt.Errorf("idempotency: the call's context ended %s: %w", when, err))
}

// failedCmd is a reply that is err.
func failedCmd(err error) *redis.Cmd {
	cmd := redis.NewCmd(context.Background())
	cmd.SetErr(err)
	return cmd
}

// batchContext is the context batch is sent in: the values of its first
// call, no cancellation (a caller that leaves must not cut the others' calls
// short), and the latest deadline of its calls, or none when one has none.
func batchContext(batch []*batchCall) (context.Context, context.CancelFunc) {
	ctx := context.WithoutCancel(batch[0].ctx)
	var latest time.Time
	for _, c := range batch {
		d, ok := c.ctx.Deadline()
		if !ok {
			return ctx, func() {}
		}
		if d.After(latest) {
			latest = d
		}
	}
	return context.WithDeadline(ctx, latest)
}

// sendScripts sends batch on c: a call alone by itself, more in one
// pipeline, each script by source when the server lacks it.
func sendScripts(c redis.UniversalClient) func(context.Context, []*batchCall) {
	return func(ctx context.Context, batch []*batchCall) {
		if len(batch) == 1 {
			batch[0].cmd = batch[0].sc.run(ctx, c, batch[0].args)
			return
		}
		_, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
			queueScripts(ctx, p, batch)
			return nil
		})
		unanswered(batch, err)
		for _, bc := range batch {
			bc.cmd = bc.sc.loaded(ctx, c, bc.args, bc.cmd)
		}
	}
}

// unanswered fails, with err, each call of batch that its pipeline left
// with neither a reply nor an error. go-redis sets a failed pipeline's error
// on its commands, except when a hook refuses the pipeline without sending
// it (a circuit breaker, say); a call so left must not pass for one the
// server applied. No reply is never an answer: a script that returns
// nothing replies redis.Nil, an error.
func unanswered(batch []*batchCall, err error) {
	for _, bc := range batch {
		if bc.cmd.Err() == nil && bc.cmd.Val() == nil {
			if err == nil {
				err = errors.New("idempotency: the pipeline carrying this call gave it no reply")
			}
			bc.cmd.SetErr(err)
		}
	}
}

// queueScripts queues the scripts of batch on p, each call with its own
// command.
func queueScripts(ctx context.Context, p redis.Pipeliner, batch []*batchCall) {
	for _, bc := range batch {
		bc.cmd = redis.NewCmd(ctx, bc.args...)
		_ = p.Process(ctx, bc.cmd)
	}
}
