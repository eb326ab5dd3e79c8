package idempotency

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
// pipeline ends with one WAIT.
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
	if o.Replicas > 0 {
		node, err := s.master(ctx, "")
		require.NoError(t, err)
		batcher = s.confirmedBatcher(node)
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
	assert.Equal(t, o.Replicas > 0, g.firstWaited.Load(), "the pipeline ends with WAIT")
	run(true)
}

// sendGate holds every send of one script (by itself, or in a pipeline
// with its WAIT) until open is closed, and runs flush before the first
// pipeline of several scripts.
type sendGate struct {
	open        chan struct{}
	held        atomic.Int64
	flush       func(context.Context) error
	first       atomic.Int64 // the scripts in the first pipeline of several
	firstWaited atomic.Bool  // that pipeline ended with WAIT
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
			g.firstWaited.Store(cmds[len(cmds)-1].Name() == "wait")
			if err := g.flush(ctx); err != nil {
				return err
			}
		}
		return next(ctx, cmds)
	}
}
