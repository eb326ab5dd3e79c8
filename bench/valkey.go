package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// The durability rows: a new operation on a Valkey server that fsyncs its
// append-only file before it answers (appendfsync always, the setting
// RedisOptions.Fsync.Master requires), without and with RedisOptions.Fsync,
// so that the second's cost is what confirming that guarantee costs.
const (
	valkeyNewOp = "valkey/new-operation"
	fsyncNewOp  = "valkey/new-operation+fsync"
)

// onValkey says whether a row runs on the Valkey server, whose CPU is
// another process's to the bench.
func onValkey(name string) bool { return strings.HasPrefix(name, "valkey/") }

// setupValkey connects to cfg.valkey, or starts a throwaway valkey-server
// with appendonly yes and appendfsync always; on failure the durability
// rows are skipped, with valkeySkip saying why.
func (e *env) setupValkey(ctx context.Context, cfg config) {
	err := func() error {
		addr := cfg.valkey
		if addr == "" {
			srv, stop, err := testserver.LaunchServer("valkey-server", "--appendonly", "yes", "--appendfsync", "always")
			if err != nil {
				return err
			}
			e.closers = append(e.closers, stop)
			addr = srv.Addr
		}
		c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: cfg.concurrency, ContextTimeoutEnabled: true})
		e.closers = append(e.closers, c.Close)
		info, err := c.Info(ctx, "server").Result()
		if err != nil {
			return err
		}
		for line := range strings.Lines(info) {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "valkey_version:"); ok {
				e.valkeyVersion = v
			}
		}
		plain, err := idempotency.NewRedisStore(c, idempotency.RedisOptions{})
		if err != nil {
			return err
		}
		e.closers = append(e.closers, plain.Close)
		fsynced, err := idempotency.NewRedisStore(c, idempotency.RedisOptions{Fsync: idempotency.Fsync{Master: true}})
		if err != nil {
			return err
		}
		e.closers = append(e.closers, fsynced.Close)
		if _, err := fsynced.CheckPersistence(ctx); err != nil {
			return err
		}
		e.valkeyGuard = idempotency.New(plain, idempotency.Options{Retention: retention})
		e.fsyncGuard = idempotency.New(fsynced, idempotency.Options{Retention: retention})
		return nil
	}()
	if err != nil {
		e.valkeySkip = "Valkey not usable: " + oneLine(err)
	}
}

// valkeyNote says what the durability rows ran on.
func (e *env) valkeyNote() string {
	if e.valkeyGuard == nil {
		return e.valkeySkip
	}
	return fmt.Sprintf("Valkey %s, appendonly yes, appendfsync always, for the %s rows", e.valkeyVersion, valkeyNewOp)
}
