package main

import (
	"context"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// tripCounter is a go-redis hook counting the requests a client sends: a
// command alone, or a pipeline of them, each one round trip (a pipeline a
// cluster client splits over several nodes counts once). The library's
// Redis store shares round trips between concurrent operations; the
// baselines make one per script.
type tripCounter struct{ n atomic.Uint64 }

func (c *tripCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *tripCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmd)
	}
}

func (c *tripCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmds)
	}
}
