package postgres_test

import (
	"context"
	_ "embed"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/internal/wire"
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

//go:embed testdata/schema-v2.sql
var schemaV2 string

// Migrate adds the column of recovery points to a table made before records
// kept them, and its rows keep working: a completed record replays, a
// released one is taken over, and an owner in flight since before the
// migration records steps and completes. Adding the column takes an ACCESS
// EXCLUSIVE lock, which waits for every transaction on the table, even one
// that only reads it; once the column is there, Migrate takes no such lock
// and runs beside such a reader.
func testMigrateRecoveryPoints(t *testing.T, f *fixture) {
	ctx := t.Context()
	o := f.options()
	o.Table += ` "o'brien"` // quotes of both kinds, in identifiers and in literals
	old := postgres.New(f.pool, o)
	t.Cleanup(old.Close)
	require.NoError(t, old.MigrateWith(ctx, schemaV2))
	// Records as that version's functions leave them.
	v2 := oldFunctions{f.pool, o.Table}
	done := v2.claim(t, "done")
	v2.call(t, "_complete", key("done"), done, wire.AppendResponse(nil, okResponse.Status, okResponse.Header, okResponse.Body),
		longRetention.Microseconds(), false)
	v2.call(t, "_release", key("released"), v2.claim(t, "released"))
	running := uint64(v2.claim(t, "running"))

	reader := readTable(t, f, o.Table)
	mctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	require.ErrorIs(t, old.Migrate(mctx), idempotency.ErrUnavailable, "adding the column beside a reader")
	cancel()
	require.NoError(t, reader.Rollback(ctx))
	migrateConcurrently(t, f, o, 4)
	reader = readTable(t, f, o.Table)
	mctx, cancel = context.WithTimeout(ctx, 2*time.Second)
	require.NoError(t, old.Migrate(mctx), "Migrate of the up-to-date table beside a reader")
	cancel()
	require.NoError(t, reader.Rollback(ctx))

	s := postgres.New(f.pool, o)
	t.Cleanup(s.Close)
	replay := claim(t, s, request("done", longLease))
	require.Equal(t, idempotency.Completed, replay.State)
	assert.Equal(t, okResponse, replay.Response)

	point := idempotency.RecoveryPoint{Step: "charge", Result: []byte(`"ch_1"`)}
	again := claim(t, s, request("released", longLease))
	require.Equal(t, idempotency.Owner, again.State)
	assert.Equal(t, 2, again.Attempt)
	requirePoints(t, s, key("released"), again.Token)
	require.NoError(t, s.SaveRecoveryPoint(ctx, key("released"), again.Token, point))
	requirePoints(t, s, key("released"), again.Token, point)

	require.NoError(t, s.SaveRecoveryPoint(ctx, key("running"), running, point))
	requirePoints(t, s, key("running"), running, point)
	require.NoError(t, s.Complete(ctx, key("running"), running, okResponse, longRetention))
	_, err := s.RecoveryPoints(ctx, key("running"), running)
	require.ErrorIs(t, err, idempotency.ErrFenced, "the points of a completed record")
	assert.Equal(t, idempotency.Completed, claim(t, s, request("running", longLease)).State)
}

// readTable opens a transaction that has read table, and so holds an
// ACCESS SHARE lock on it until it ends.
func readTable(t *testing.T, f *fixture, table string) pgx.Tx {
	t.Helper()
	tx, err := f.pool.Begin(t.Context())
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	_, err = tx.Exec(t.Context(), "SELECT FROM "+pgx.Identifier{table}.Sanitize()+" LIMIT 1")
	require.NoError(t, err)
	return tx
}

// requirePoints requires the recovery points that token reads of k's
// record to be want.
func requirePoints(t *testing.T, s *postgres.Store, k idempotency.Key, token uint64, want ...idempotency.RecoveryPoint) {
	t.Helper()
	got, err := s.RecoveryPoints(t.Context(), k, token)
	require.NoError(t, err)
	require.Equal(t, want, got)
}

// oldFunctions calls the functions of an earlier version's schema on a
// table, as that version's Store did.
type oldFunctions struct {
	pool  *pgxpool.Pool
	table string
}

// claim claims the record of key(name) as request(name, longLease) does,
// and returns its owner's token.
func (o oldFunctions) claim(t *testing.T, name string) int64 {
	t.Helper()
	req := request(name, longLease)
	var (
		state string
		token int64
	)
	require.NoError(t, o.pool.QueryRow(t.Context(), "SELECT o_state, o_token FROM "+pgx.Identifier{o.table + "_claim"}.Sanitize()+
		"($1, $2, $3, $4, $5, $6, false)", req.Key.Scope, req.Key.Name, req.Fingerprint[:], req.OperationID,
		req.Lease.Microseconds(), req.Retention.Microseconds()).Scan(&state, &token))
	require.Equal(t, "owner", state)
	return token
}

// call calls the owner's function of the table named by suffix, for the
// owner of k's record with token, and requires it to have changed the
// record.
func (o oldFunctions) call(t *testing.T, suffix string, k idempotency.Key, token int64, args ...any) {
	t.Helper()
	args = append([]any{k.Scope, k.Name, token}, args...)
	marks := make([]string, len(args))
	for i := range args {
		marks[i] = fmt.Sprintf("$%d", i+1)
	}
	var changed bool
	require.NoError(t, o.pool.QueryRow(t.Context(), "SELECT "+pgx.Identifier{o.table + suffix}.Sanitize()+
		"("+strings.Join(marks, ", ")+")", args...).Scan(&changed))
	require.True(t, changed, "%s of %v", suffix, k)
}
