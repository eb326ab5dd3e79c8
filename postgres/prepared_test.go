package postgres_test

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest"
)

// countingConn counts the writes a client makes on its connection: each
// flush of requests is one, and every owner's call must be one round trip.
type countingConn struct {
	net.Conn
	writes *atomic.Int64
}

func (c countingConn) Write(b []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(b)
}

// onePool returns a pool of one connection to f's database, configured by
// set, whose writes count.
func onePool(t *testing.T, f *fixture, set func(*pgxpool.Config)) (*pgxpool.Pool, *atomic.Int64) {
	cfg := f.pool.Config()
	cfg.MinConns, cfg.MaxConns = 0, 1
	writes := new(atomic.Int64)
	dial := cfg.ConnConfig.DialFunc
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return countingConn{Conn: c, writes: writes}, nil
	}
	if set != nil {
		set(cfg)
	}
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, writes
}

// deallocateAll drops every statement prepared on pool's connection, as
// pgx does.
func deallocateAll(t *testing.T, pool *pgxpool.Pool) {
	require.NoError(t, pool.AcquireFunc(t.Context(), func(c *pgxpool.Conn) error {
		return c.Conn().DeallocateAll(t.Context())
	}))
}

// An owner's write takes one round trip on a connection that never ran it
// (its statement is prepared in the same pipeline) and on one that did,
// and one that lost its prepared statements behind the Store's back
// prepares them again.
func testOwnerWritesPrepared(t *testing.T, f *fixture) {
	ctx := t.Context()
	pool, writes := onePool(t, f, nil)
	s, _ := f.storeOn(t, pool)
	prepared := func() (n int) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_prepared_statements
			WHERE name LIKE 'idempotency\_%'`).Scan(&n))
		return n
	}
	oneTrip := func(what string, call func() error) {
		t.Helper()
		before := writes.Load()
		require.NoError(t, call(), what)
		assert.Equal(t, int64(1), writes.Load()-before, "%s: writes on the connection", what)
	}
	resp := idempotency.Response{Status: 201, Body: []byte("ok")}
	for i, name := range []string{"fresh", "prepared"} {
		c := claim(t, s, request(name, time.Minute))
		oneTrip(name+" heartbeat", func() error { return s.Heartbeat(ctx, key(name), c.Token, time.Minute) })
		oneTrip(name+" complete", func() error { return s.Complete(ctx, key(name), c.Token, resp, longRetention) })
		assert.Equal(t, 2, prepared(), "after run %d", i+1)
	}

	deallocateAll(t, pool)
	c := claim(t, s, request("deallocated", time.Minute))
	require.NoError(t, s.Complete(ctx, key("deallocated"), c.Token, resp, longRetention), "a statement the connection lost")
	assert.Equal(t, 1, prepared())
	assert.Equal(t, idempotency.Completed, claim(t, s, request("deallocated", time.Minute)).State)
}

// In a transaction, a statement the connection lost fails the call, which
// rolls the transaction back, and changes nothing: the owner still owns
// the record.
func testOwnerWriteInTxLostStatement(t *testing.T, f *fixture) {
	ctx := t.Context()
	pool, _ := onePool(t, f, nil)
	s, _ := f.storeOn(t, pool)
	resp := idempotency.Response{Status: 201, Body: []byte("ok")}
	warm := claim(t, s, request("warm", time.Minute))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return s.CompleteTxAs(ctx, tx, key("warm"), warm.Token, resp, longRetention)
	}))

	c := claim(t, s, request("lost", time.Minute))
	deallocateAll(t, pool)
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return s.CompleteTxAs(ctx, tx, key("lost"), c.Token, resp, longRetention)
	})
	require.ErrorIs(t, err, idempotency.ErrUnavailable)
	assert.Equal(t, idempotency.InFlight, claim(t, s, request("lost", time.Minute)).State)
	require.NoError(t, s.Complete(ctx, key("lost"), c.Token, resp, longRetention), "the owner, outside a transaction")
}

// A pool that runs every statement unprepared (as for a transaction-pooling
// proxy) keeps the contract, and the Store prepares nothing on it.
func testSimpleProtocolPool(t *testing.T, f *fixture) {
	t.Parallel() // beside Conformance, on a pool of its own
	pool, _ := onePool(t, f, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 4
		cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	})
	idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness {
		s, _ := f.storeOn(t, pool)
		return idempotencytest.Harness{Store: s}
	})
	var n int
	require.NoError(t, pool.QueryRow(t.Context(), `SELECT count(*) FROM pg_prepared_statements`).Scan(&n))
	assert.Zero(t, n, "statements prepared on a pool that prepares none")
}
