package postgres_test

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/restarttest"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
)

// Issue 15's store restart on PostgreSQL: an immediate shutdown under load,
// then crash recovery on the same data directory. Nothing committed may be
// lost; the Store's pool and its LISTEN connection must come back without
// the application's help: calls fail closed while the server is down, then
// succeed, and a waiter subscribed across the restart is woken and answered.
func TestRestart(t *testing.T) {
	pg := testserver.StartPostgres(t)
	cfg, err := pgxpool.ParseConfig(pg.DSN)
	require.NoError(t, err)
	cfg.MaxConns = 24 // the load's callers, the LISTEN connection and some to spare
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	s := postgres.New(pool, postgres.Options{})
	require.NoError(t, s.Migrate(t.Context()))
	t.Cleanup(s.Close)
	restarttest.Run(t, restarttest.Rig{
		Name: "postgres", Fault: "immediate-shutdown", Store: s, Durable: true,
		Kill:  func(t *testing.T) { pg.Stop(t) },
		Start: func(t *testing.T) { pg.Restart(t) },
	})
}
