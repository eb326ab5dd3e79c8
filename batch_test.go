package idempotency

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

func TestRedisBatchedCalls(t *testing.T) {
	redisBackends(t, func(t *testing.T, c *redis.Client) {
		batchedCalls(t, c, RedisOptions{}, func(ctx context.Context) error { return c.ScriptFlush(ctx).Err() })
	})
}

// batchedCalls holds maxFlying sends at a gate while more operations queue
// behind them, then opens it: the queue goes out as one pipeline, whose
// scripts the server has just forgotten, and still every operation gets its
// own reply, then every replay its own response. With o.Replicas set, the
// pipeline ends with one WAIT; with o.Fsync, with one WAITAOF.
func batchedCalls(t *testing.T, c redis.UniversalClient, o RedisOptions, flush func(context.Context) error) {
	const n = 40
	ctx := context.Background()
	g := &sendGate{open: make(chan struct{}), flush: flush}
	c.AddHook(g)
	s, err := NewRedisStore(c, o)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	guard := New(s, Options{})
	batcher := s.batch
	if o.Replicas > 0 || o.Fsync.on() {
		node, err := s.master(ctx, "")
		require.NoError(t, err)
		batcher = s.confirmedNode(node).batch
	}
	key := func(i int) (Key, Fingerprint) {
		k := Key{Scope: "batch", Name: fmt.Sprint("k", i)}
		return k, FingerprintOf("op", []byte(k.Name))
	}
	run := func(replay bool) {
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				k, fp := key(i)
				r, err := guard.Do(ctx, k, fp, func(context.Context) (Response, error) {
					return Response{Status: 201, Body: []byte("body of " + k.Name)}, nil
				})
				if assert.NoError(t, err, k.Name) {
					assert.Equal(t, "body of "+k.Name, string(r.Response.Body))
					assert.Equal(t, replay, r.Replayed, k.Name)
				}
			})
		}
		if !replay {
			require.Eventually(t, func() bool {
				batcher.mu.Lock()
				defer batcher.mu.Unlock()
				return g.held.Load() == maxFlying && len(batcher.queue) == n-maxFlying
			}, 10*time.Second, time.Millisecond, "sends held at the gate, the other calls queued")
			close(g.open)
		}
		wg.Wait()
	}
	run(false)
	assert.Equal(t, int64(n-maxFlying), g.first.Load(), "the queued claims went out in one pipeline")
	var waits []string
	if o.Replicas > 0 {
		waits = append(waits, "wait")
	}
	if o.Fsync.on() {
		waits = append(waits, "waitaof")
	}
	assert.Equal(t, waits, g.firstWaits, "the commands that end the pipeline, once each")
	run(true)
}

// sendGate holds every send of one script (by itself, or in a pipeline
// with its WAIT) until open is closed, and runs flush before the first
// pipeline of several scripts.
type sendGate struct {
	open       chan struct{}
	held       atomic.Int64
	flush      func(context.Context) error
	first      atomic.Int64 // the scripts in the first pipeline of several
	firstWaits []string     // the commands after that pipeline's scripts, set before its send
}

func (g *sendGate) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) { return next(ctx, network, addr) }
}

func (g *sendGate) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "evalsha" {
			g.held.Add(1)
			<-g.open
		}
		return next(ctx, cmd)
	}
}

func (g *sendGate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		scripts := 0
		for _, cmd := range cmds {
			if cmd.Name() == "evalsha" {
				scripts++
			}
		}
		// Neither kind: the pipelines go-redis sends of its own on a new
		// connection, or a script sent again by source.
		switch {
		case scripts == 1:
			g.held.Add(1)
			<-g.open
		case scripts > 1 && g.first.CompareAndSwap(0, int64(scripts)):
			for _, cmd := range cmds {
				if cmd.Name() != "evalsha" {
					g.firstWaits = append(g.firstWaits, cmd.Name())
				}
			}
			if err := g.flush(ctx); err != nil {
				return err
			}
		}
		return next(ctx, cmds)
	}
}

// A queued call returns when its context ends: one still in the queue
// leaves it unsent, one whose pipeline is on its way fails at once while the
// pipeline goes on, and the pipeline runs until the latest deadline of its
// calls, so that the calls that still wait get their replies.
func TestBatcherCallsEndByTheirDeadline(t *testing.T) {
	gate := make(chan struct{})
	var mu sync.Mutex
	var sent [][]string
	var deadlines []time.Time
	b := &batcher{send: func(ctx context.Context, batch []*batchCall) {
		var names []string
		for _, c := range batch {
			names = append(names, c.args[0].(string))
		}
		d, _ := ctx.Deadline()
		mu.Lock()
		sent, deadlines = append(sent, names), append(deadlines, d)
		mu.Unlock()
		<-gate
		for _, c := range batch {
			c.cmd = redis.NewCmd(ctx)
			c.cmd.SetVal(c.args[0])
		}
	}}
	call := func(ctx context.Context, name string) <-chan *redis.Cmd {
		done := make(chan *redis.Cmd, 1)
		go func() { done <- b.run(ctx, nil, []any{name}).cmd }()
		return done
	}
	queued := func(n int) func() bool {
		return func() bool {
			b.mu.Lock()
			defer b.mu.Unlock()
			return len(b.queue) == n
		}
	}
	var flying []<-chan *redis.Cmd
	for i := range maxFlying {
		flying = append(flying, call(context.Background(), fmt.Sprint("alone", i)))
	}
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(sent) == maxFlying }, 5*time.Second, time.Millisecond)

	// Queued, then its context ends: it leaves the queue, unsent.
	ctx, cancel := context.WithCancel(context.Background())
	left := call(ctx, "left")
	require.Eventually(t, queued(1), 5*time.Second, time.Millisecond)
	cancel()
	cmd := <-left
	assert.ErrorIs(t, cmd.Err(), context.Canceled)
	assert.ErrorContains(t, cmd.Err(), "before it was sent")
	assert.True(t, queued(0)())

	// Two calls queue; their pipeline goes out when a send ends.
	soon, cancelSoon := context.WithTimeout(context.Background(), time.Hour)
	defer cancelSoon()
	later, cancelLater := context.WithTimeout(context.Background(), 2*time.Hour)
	defer cancelLater()
	short, long := call(soon, "short"), call(later, "long")
	require.Eventually(t, queued(2), 5*time.Second, time.Millisecond)
	gate <- struct{}{} // one of the sends alone ends
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(sent) == maxFlying+1 }, 5*time.Second, time.Millisecond)
	mu.Lock()
	assert.ElementsMatch(t, []string{"short", "long"}, sent[maxFlying], "the queued calls went out together")
	d, _ := later.Deadline()
	assert.Equal(t, d, deadlines[maxFlying], "the pipeline's deadline is its latest call's")
	mu.Unlock()
	cancelSoon()
	cmd = <-short
	assert.ErrorIs(t, cmd.Err(), context.Canceled)
	assert.ErrorContains(t, cmd.Err(), "on its way")

	close(gate)
	cmd = <-long
	require.NoError(t, cmd.Err(), "the call still waiting got its reply")
	assert.Equal(t, "long", cmd.Val())
	replies := 0
	for _, f := range flying {
		if (<-f).Err() == nil {
			replies++
		}
	}
	assert.Equal(t, maxFlying, replies)
	// A turn ends after its last reply is delivered: its sender then finds
	// the queue empty.
	assert.Eventually(t, func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return b.flying == 0
	}, 5*time.Second, time.Millisecond, "a turn in flight did not end")
}

// A queued call whose context ended by the time its pipeline goes out is
// not sent, and a panic in a pipeline's send fails its calls, not the
// process: every call is answered and the turn in flight goes on.
func TestBatcherSendsOnlyLiveCallsAndSurvivesAPanic(t *testing.T) {
	var sent [][]any
	b := &batcher{flying: 1, send: func(ctx context.Context, batch []*batchCall) {
		var args []any
		for _, c := range batch {
			args = append(args, c.args[0])
		}
		sent = append(sent, args)
		for _, c := range batch {
			if c.args[0] == "panics" {
				panic("a hook's bug")
			}
			c.cmd = redis.NewCmd(ctx)
			c.cmd.SetVal(c.args[0])
		}
	}}
	queued := func(ctx context.Context, name string) *batchCall {
		return &batchCall{args: []any{name}, ctx: ctx, replied: make(chan struct{})}
	}
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	gone, live := queued(ended, "gone"), queued(context.Background(), "live")
	// Queued behind them, for the same turn: a pipeline that panics.
	panics, after := queued(context.Background(), "panics"), queued(context.Background(), "after")
	b.queue = []*batchCall{panics, after}
	b.sendQueued([]*batchCall{gone, live})

	assert.Equal(t, [][]any{{"live"}, {"panics", "after"}}, sent)
	for _, c := range []*batchCall{gone, live, panics, after} {
		select {
		case <-c.replied:
		default:
			t.Fatalf("call %v was never let go", c.args[0])
		}
	}
	assert.ErrorIs(t, gone.cmd.Err(), context.Canceled)
	assert.ErrorContains(t, gone.cmd.Err(), "before it was sent")
	assert.Equal(t, "live", live.cmd.Val())
	for _, c := range []*batchCall{panics, after} {
		assert.ErrorContains(t, c.cmd.Err(), "panicked: a hook's bug")
	}
	assert.Zero(t, b.flying, "the turn in flight did not end")
}

// A go-redis hook may fail a command without sending it (a circuit breaker
// that is open, say): go-redis sets that error on a command sent by itself,
// but not on the commands of a pipeline, whose error Pipelined returns.
// Every call of such a pipeline must still fail: a Complete that reports
// success though nothing was stored loses the outcome (and lets a retry run
// the operation again), and a Heartbeat that does has its owner count on a
// lease the server never extended.
func TestRedisPipelineRefusedByAHookFailsItsCalls(t *testing.T) {
	srv := testserver.StartRedis(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { c.Close() })
	s := newRedisStore(t, c)
	ctx := context.Background()
	const n = maxFlying + 2
	keys, tokens := make([]Key, n), make([]uint64, n)
	for i := range n {
		keys[i] = Key{Scope: "breaker", Name: fmt.Sprint("k", i)}
		cl, err := s.Claim(ctx, ClaimRequest{Key: keys[i], Fingerprint: FingerprintOf("op", nil), OperationID: fmt.Sprint("op", i), Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		require.Equal(t, Owner, cl.State)
		tokens[i] = cl.Token
	}
	b := &breaker{gate: make(chan struct{})}
	b.open.Store(true)
	c.AddHook(b)

	errs := make([]error, n)
	var wg sync.WaitGroup
	call := func(i int) {
		wg.Go(func() {
			if i == n-2 {
				errs[i] = s.Heartbeat(ctx, keys[i], tokens[i], time.Minute)
				return
			}
			errs[i] = s.Complete(ctx, keys[i], tokens[i], Response{Status: 201, Body: []byte(keys[i].Name)}, time.Hour)
		})
	}
	for i := range maxFlying {
		call(i)
	}
	require.Eventually(t, func() bool { return b.held.Load() == maxFlying }, 5*time.Second, time.Millisecond)
	for i := maxFlying; i < n; i++ {
		call(i)
	}
	require.Eventually(t, func() bool {
		s.batch.mu.Lock()
		defer s.batch.mu.Unlock()
		return len(s.batch.queue) == n-maxFlying
	}, 5*time.Second, time.Millisecond, "the last calls queued")
	close(b.gate)
	wg.Wait()
	b.open.Store(false)
	for i, err := range errs {
		assert.ErrorIs(t, err, ErrUnavailable, "call %d: the breaker refused it, nothing was sent", i)
	}
	// What the server holds: the refused completion was never stored.
	last := n - 1
	cl, err := s.Claim(ctx, ClaimRequest{Key: keys[last], Fingerprint: FingerprintOf("op", nil), OperationID: "a retry", Lease: time.Minute, Retention: time.Hour})
	require.NoError(t, err)
	assert.Equal(t, InFlight, cl.State, "no completion is stored, whatever Complete said")
}

var errBreakerOpen = errors.New("circuit breaker open")

// breaker is a go-redis hook that, while open, fails every command without
// sending it; it holds a script sent by itself at gate first.
type breaker struct {
	open atomic.Bool
	gate chan struct{}
	held atomic.Int64
}

func (b *breaker) DialHook(next redis.DialHook) redis.DialHook { return next }

func (b *breaker) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !b.open.Load() {
			return next(ctx, cmd)
		}
		if cmd.Name() == "evalsha" {
			b.held.Add(1)
			<-b.gate
		}
		return errBreakerOpen
	}
}

func (b *breaker) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if !b.open.Load() {
			return next(ctx, cmds)
		}
		return errBreakerOpen
	}
}
