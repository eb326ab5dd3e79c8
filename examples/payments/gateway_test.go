package main

import (
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// backend is the services of a charge, which every implementation is.
type backend interface {
	orders
	gateway
	receipts
	ledger
}

// TestBackends runs the checks on the Redis and the PostgreSQL
// implementation, each on a server of its own, with no gateway latency.
func TestBackends(t *testing.T) {
	t.Parallel()
	checks := func(t *testing.T, b backend) {
		t.Run("gateway agrees on one charge", func(t *testing.T) { testGatewayAgreesOnOneCharge(t, b) })
		t.Run("gateway lookup is not a call", func(t *testing.T) { testGatewayLookup(t, b) })
		t.Run("ledger refuses stale attempts", func(t *testing.T) { testLedgerRefusesStaleAttempts(t, b) })
		t.Run("orders and receipts by operation", func(t *testing.T) { testRowsByOperation(t, b) })
	}
	t.Run("redis", func(t *testing.T) {
		t.Parallel()
		checks(t, &redisBackend{c: testserver.StartRedis(t).Client()})
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		pool, err := pgxpool.New(t.Context(), testserver.StartPostgres(t).DSN)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		b, err := newPostgresBackend(t.Context(), pool, nil, 0)
		require.NoError(t, err)
		checks(t, b)
	})
}

// Concurrent calls with one downstream key, as a takeover racing a stalled
// owner makes them, agree on one charge.
func testGatewayAgreesOnOneCharge(t *testing.T, g gateway) {
	const calls = 20
	req := chargeRequest{Amount: 4200, Currency: "usd", Source: "tok_visa"}
	got := make([]charge, calls)
	errs := make([]error, calls)
	var wg sync.WaitGroup
	for i := range calls {
		wg.Go(func() { got[i], errs[i] = g.charge(t.Context(), "idem_same", req) })
	}
	wg.Wait()
	for i := range calls {
		require.NoError(t, errs[i])
		require.Equal(t, got[0], got[i])
	}
	assert.Equal(t, charge{ID: got[0].ID, Amount: 4200, Currency: "usd", Source: "tok_visa", Status: "succeeded"}, got[0])

	other, err := g.charge(t.Context(), "idem_other", req)
	require.NoError(t, err)
	assert.NotEqual(t, got[0].ID, other.ID)
	s, err := g.stats(t.Context())
	require.NoError(t, err)
	assert.Equal(t, gatewayStats{Calls: calls + 1, Charges: 2}, s)
}

// A lookup finds the charge a call made under its key, and nothing under a
// key no call used; it neither charges nor counts as a call.
func testGatewayLookup(t *testing.T, g gateway) {
	ctx := t.Context()
	before, err := g.stats(ctx)
	require.NoError(t, err)
	_, found, err := g.lookup(ctx, "idem_lookup")
	require.NoError(t, err)
	assert.False(t, found, "a charge under a key no call used")

	made, err := g.charge(ctx, "idem_lookup", chargeRequest{Amount: 700, Currency: "eur", Source: "tok_mc"})
	require.NoError(t, err)
	for range 3 {
		got, found, err := g.lookup(ctx, "idem_lookup")
		require.NoError(t, err)
		require.True(t, found)
		require.Equal(t, made, got)
	}
	after, err := g.stats(ctx)
	require.NoError(t, err)
	assert.Equal(t, gatewayStats{Calls: before.Calls + 1, Charges: before.Charges + 1}, after)
}

// The ledger takes a charge from the newest attempt that wrote it, and from
// no older one; tokens compare as numbers, exactly, however large.
func testLedgerRefusesStaleAttempts(t *testing.T, l ledger) {
	ctx := t.Context()
	c := charge{ID: "ch_1", Amount: 4200, Currency: "usd", Source: "tok_visa", Status: "succeeded"}
	require.NoError(t, l.record(ctx, c, 9))
	require.NoError(t, l.record(ctx, c, 10))
	require.ErrorIs(t, l.record(ctx, c, 9), errStale)
	require.NoError(t, l.record(ctx, c, 10), "the same attempt may write again")
	require.NoError(t, l.record(ctx, c, 1<<60+1))
	require.ErrorIs(t, l.record(ctx, c, 1<<60), errStale)

	got, err := l.get(ctx, c.ID)
	require.NoError(t, err)
	assert.Equal(t, c, got)
	_, err = l.get(ctx, "ch_none")
	require.ErrorIs(t, err, errNotFound)
	d := charge{ID: "ch_0", Amount: 1, Currency: "eur", Source: "tok_x", Status: "succeeded"}
	require.NoError(t, l.record(ctx, d, 1))
	all, err := l.list(ctx)
	require.NoError(t, err)
	assert.Equal(t, []charge{d, c}, all)
}

// An operation's order and receipt are found by the operation, and an
// operation that placed or sent none has none.
func testRowsByOperation(t *testing.T, b backend) {
	ctx := t.Context()
	o := order{ID: "ord_1", Operation: "op_1", Attempt: 2, Amount: 4200, Currency: "usd", Source: "tok_visa"}
	require.NoError(t, b.place(ctx, o))
	got, found, err := b.placedBy(ctx, "op_1")
	require.NoError(t, err)
	require.True(t, found)
	assert.Equal(t, o, got)
	_, found, err = b.placedBy(ctx, "op_2")
	require.NoError(t, err)
	assert.False(t, found)

	r := receipt{ID: "rc_1", Operation: "op_1", Attempt: 3, Order: o.ID, Charge: "ch_1", Amount: 4200, Currency: "usd"}
	require.NoError(t, b.send(ctx, r))
	sent, found, err := b.sentFor(ctx, "op_1")
	require.NoError(t, err)
	require.True(t, found)
	assert.Equal(t, r, sent)
	_, found, err = b.sentFor(ctx, "op_2")
	require.NoError(t, err)
	assert.False(t, found)
}
