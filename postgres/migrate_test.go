package postgres_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
)

// Migrate runs at every instance's start. Run again on a table already up to
// date, it must not queue the Store's own statements behind a lock they do
// not otherwise wait for: here a CompleteTx transaction on one key still
// open (a slow business transaction) while an instance starts. Claims of
// other keys run beside such a transaction; they must keep running while
// the new instance migrates.
func TestMigrateDoesNotStallClaims(t *testing.T) {
	pg := testserver.StartPostgres(t)
	cfg, err := pgxpool.ParseConfig(pg.DSN)
	require.NoError(t, err)
	s, pool := migratedStore(t, cfg)
	ctx := t.Context()

	// A business transaction that completed its record and has not committed yet.
	busy := claim(t, s, request("busy", longLease))
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	require.NoError(t, s.CompleteTxAs(ctx, tx, key("busy"), busy.Token, okResponse, longRetention))

	// Without a migration, a claim of another key runs at once.
	cctx, cancel := context.WithTimeout(ctx, time.Second)
	_, err = s.Claim(cctx, request("before", longLease))
	cancel()
	require.NoError(t, err, "a claim beside the open transaction")

	// Another instance starts and migrates the same, up-to-date table.
	other := postgres.New(pool, postgres.Options{})
	t.Cleanup(other.Close)
	migrated := make(chan error, 1)
	go func() { migrated <- other.Migrate(ctx) }()
	time.Sleep(300 * time.Millisecond)

	cctx, cancel = context.WithTimeout(ctx, time.Second)
	start := time.Now()
	_, err = s.Claim(cctx, request("during", longLease))
	cancel()
	require.NoError(t, err, "a claim while an instance migrates the up-to-date table (waited %v)", time.Since(start).Round(time.Millisecond))

	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, <-migrated)
}

// An instance starting under steady traffic whose CompleteTx business
// transactions last longer than the migration's lock timeout (here 300 ms,
// one starting every 100 ms, so that one is always open that began less
// than 100 ms ago) must still get through Migrate of the up-to-date table,
// as it did when Migrate simply waited its turn: CREATE INDEX IF NOT EXISTS
// takes its SHARE lock even when the index exists, every attempt finds a
// transaction on the table that will not end within the lock timeout, and
// retrying the same timeout starves the migration for as long as the
// traffic lasts.
func TestMigrateUnderSteadyLongTransactions(t *testing.T) {
	pg := testserver.StartPostgres(t)
	cfg, err := pgxpool.ParseConfig(pg.DSN)
	require.NoError(t, err)
	cfg.MaxConns = 16
	s, pool := migratedStore(t, cfg)

	ctx, stop := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	for g := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(g) * 100 * time.Millisecond)
			for i := 0; ctx.Err() == nil; i++ {
				req := request(fmt.Sprintf("steady-%d-%d", g, i), longLease)
				c, err := s.Claim(ctx, req)
				if err != nil {
					continue
				}
				tx, err := pool.Begin(ctx)
				if err != nil {
					continue
				}
				_ = s.CompleteTxAs(ctx, tx, req.Key, c.Token, okResponse, longRetention)
				time.Sleep(300 * time.Millisecond) // the business transaction's own work
				_ = tx.Commit(context.WithoutCancel(ctx))
			}
		}()
	}
	defer func() { stop(); wg.Wait() }()
	time.Sleep(500 * time.Millisecond)

	other := postgres.New(pool, postgres.Options{})
	t.Cleanup(other.Close)
	mctx, cancel := context.WithTimeout(t.Context(), 8*time.Second)
	defer cancel()
	start := time.Now()
	err = other.Migrate(mctx)
	require.NoError(t, err, "Migrate of the up-to-date table under steady traffic (after %v)", time.Since(start).Round(time.Millisecond))
}

// migratedStore returns a Store with default Options on a pool made from
// cfg, its schema migrated, both closed when t ends.
func migratedStore(t *testing.T, cfg *pgxpool.Config) (*postgres.Store, *pgxpool.Pool) {
	t.Helper()
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	s := postgres.New(pool, postgres.Options{})
	t.Cleanup(s.Close)
	require.NoError(t, s.Migrate(t.Context()))
	return s, pool
}
