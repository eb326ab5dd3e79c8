package postgres_test

import (
	"context"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/postgres"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A claim draws a new record's token in its INSERT, before the conflict
// check. One held at that check for longer than the store allows (here
// behind another transaction's insert of the same key, which then rolls
// back) draws again once the row is its own: its token is greater than one
// drawn by a claim that ran while it waited.
func testSlowClaimDrawsAgain(t *testing.T, f *fixture) {
	s, o := f.store(t)
	ctx := t.Context()
	req := request("pay", longLease)

	tx, err := f.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	_, err = tx.Exec(ctx, `INSERT INTO `+o.Table+` (scope, key, fingerprint, state, attempt, operation_id, lease_until, expires_at)
		VALUES ($1, $2, '\x00', 'released', 1, 'op', now(), now() + interval '1 hour')`, req.Key.Scope, req.Key.Name)
	require.NoError(t, err)

	claimed := make(chan idempotency.Claim, 1)
	go func() {
		c, err := s.Claim(ctx, req)
		assert.NoError(t, err)
		claimed <- c
	}()
	f.waitForLock(t, o.Table, "the claim never waited for the insert")

	// A claim of another key, while the first waits, draws a later token.
	meanwhile := claim(t, s, request("other", longLease))
	time.Sleep(1200 * time.Millisecond) // longer than a claim may take and keep its draw
	require.NoError(t, tx.Rollback(ctx))

	c := <-claimed
	require.Equal(t, idempotency.Owner, c.State)
	assert.Greater(t, c.Token, meanwhile.Token, "the slow claim kept the token it drew before it waited")
	require.NoError(t, s.Complete(ctx, req.Key, c.Token, okResponse, longRetention), "the token drawn again owns the record")
}

// A forgotten record counts as absent at once, and stays in the table until
// DeleteExpired's grace has passed, the same as an expired one.
func testForgottenRecordGrace(t *testing.T, f *fixture) {
	s, o := f.store(t)
	ctx := t.Context()
	req := request("pay", longLease)
	c := claim(t, s, req)
	require.NoError(t, s.Forget(ctx, req.Key, c.Token))

	rows := func() int {
		var n int
		require.NoError(t, f.pool.QueryRow(ctx, `SELECT count(*) FROM `+o.Table).Scan(&n))
		return n
	}
	n, err := s.DeleteExpired(ctx)
	require.NoError(t, err)
	assert.Zero(t, n, "a record forgotten just now was deleted")
	assert.Equal(t, 1, rows())

	// Absent to claims meanwhile, whatever the request.
	other := req
	other.Fingerprint, other.OperationID = fp("another body"), "op_other"
	again := claim(t, s, other)
	require.Equal(t, idempotency.Owner, again.State)
	assert.Equal(t, 1, again.Attempt)
	assert.Equal(t, "op_other", again.OperationID)
	assert.Greater(t, again.Token, c.Token)
	require.NoError(t, s.Forget(ctx, req.Key, again.Token))

	time.Sleep(2300 * time.Millisecond) // the grace
	n, err = s.DeleteExpired(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 1, n)
	assert.Zero(t, rows())
}

// The Store vouches that its calls end by their deadline for a pool with
// pgx's default handling of an ended context, and for itself only.
func TestEndsByDeadline(t *testing.T) {
	const dsn = "postgres://nobody@127.0.0.1:1/none?sslmode=disable" // never dialled
	newPool := func(t *testing.T, build func(*pgxpool.Config)) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(dsn)
		require.NoError(t, err)
		if build != nil {
			build(cfg)
		}
		pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		return pool
	}
	s := postgres.New(newPool(t, nil), postgres.Options{})
	assert.True(t, s.EndsByDeadline(s), "pgx's default handler")

	wrapped := struct{ *postgres.Store }{s}
	assert.False(t, s.EndsByDeadline(wrapped), "a type embedding the Store")

	waits := postgres.New(newPool(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
			return &pgconn.CancelRequestContextWatcherHandler{Conn: c, CancelRequestDelay: time.Second, DeadlineDelay: 2 * time.Second}
		}
	}), postgres.Options{})
	assert.False(t, waits.EndsByDeadline(waits), "a handler that cancels on the server first")

	late := postgres.New(newPool(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
			return &pgconn.DeadlineContextWatcherHandler{DeadlineDelay: time.Second}
		}
	}), postgres.Options{})
	assert.False(t, late.EndsByDeadline(late), "a deadline set a second late")
}
