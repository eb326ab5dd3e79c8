package idempotency

import (
	"context"
	"errors"
	"sync"

	"github.com/redis/go-redis/v9"
)

// batcher sends the scripts of concurrent operations to Redis together.
// A call finding fewer than maxFlying sends in flight is sent at once, by
// itself; a call arriving while they are all in flight queues, and when one
// of them ends, every call queued meanwhile goes out in one pipeline, led by
// the first of them. Under load most round trips then carry many scripts,
// and the system calls a round trip costs, on the client and on the server,
// are shared; an idle store sends each script alone, at once.
//
// Each call keeps its own command, filled in by the pipeline in order, so
// no reply can reach another call. A queued call waits for the send ahead of
// it whatever its context says: that send ends within the client's
// timeouts, and a call must not leave a queue it may be asked to lead.
type batcher struct {
	// send sends the calls of batch, one or more, and sets the replies of
	// each; its context is the leader's, without cancellation when the
	// batch holds other calls too.
	send func(ctx context.Context, batch []*batchCall)

	mu     sync.Mutex
	queue  []*batchCall
	flying int // sends in flight, each led by one call
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
	cmd  *redis.Cmd        // the script's reply
	acks *redis.Cmd        // the reply of the WAIT for replicas sent after it, if any
	lead chan []*batchCall // for a queued call: nil once sent, or a batch to lead
	self [1]*batchCall     // the call as a batch of one, without allocating one
}

// run sends sc with args (made by sc.args) and returns the call, sent.
func (b *batcher) run(ctx context.Context, sc *script, args []any) *batchCall {
	c := &batchCall{sc: sc, args: args}
	b.mu.Lock()
	if b.flying < maxFlying {
		b.flying++
		b.mu.Unlock()
		b.lead(ctx, c, nil)
		return c
	}
	c.lead = make(chan []*batchCall, 1)
	b.queue = append(b.queue, c)
	b.mu.Unlock()
	if batch := <-c.lead; batch != nil {
		b.lead(ctx, c, batch)
	}
	return c
}

// lead sends batch, which leader belongs to (nil: leader alone), then
// hands the calls queued meanwhile to the first of them, or ends its turn
// in flight.
func (b *batcher) lead(ctx context.Context, leader *batchCall, batch []*batchCall) {
	// Deferred: whatever happens here, no queued call is left waiting.
	defer b.handOff(leader, batch)
	if len(batch) <= 1 {
		leader.self[0] = leader
		b.send(ctx, leader.self[:])
		return
	}
	// The leader's context must not cut the other calls short.
	b.send(context.WithoutCancel(ctx), batch)
}

// handOff ends a send that leader led. The calls queued meanwhile, up to
// maxBatch, go to the first of them, which leads them as the next send;
// with none queued, the leader's turn in flight ends. Then the other calls
// of batch, waiting in run for their send to end, are let go, and any the
// pipeline gave no reply fail.
func (b *batcher) handOff(leader *batchCall, batch []*batchCall) {
	b.mu.Lock()
	next := b.queue[:min(len(b.queue), maxBatch)]
	b.queue = b.queue[len(next):]
	if len(next) == 0 {
		b.flying--
	}
	b.mu.Unlock()
	if len(next) > 0 {
		next[0].lead <- next
	}
	for _, c := range batch {
		if c != leader {
			if c.cmd == nil {
				c.cmd = redis.NewCmd(context.Background())
				c.cmd.SetErr(errors.New("idempotency: the pipeline carrying this call failed"))
			}
			c.lead <- nil
		}
	}
}

// sendScripts sends batch on c: a call alone by itself, more in one
// pipeline, each script by source when the server lacks it.
func sendScripts(c redis.UniversalClient) func(context.Context, []*batchCall) {
	return func(ctx context.Context, batch []*batchCall) {
		if len(batch) == 1 {
			batch[0].cmd = batch[0].sc.run(ctx, c, batch[0].args)
			return
		}
		_, _ = c.Pipelined(ctx, func(p redis.Pipeliner) error {
			queueScripts(ctx, p, batch)
			return nil
		})
		for _, bc := range batch {
			bc.cmd = bc.sc.loaded(ctx, c, bc.args, bc.cmd)
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
