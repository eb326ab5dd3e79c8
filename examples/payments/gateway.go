package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/postgres"
)

// charge is a charge as the provider returns it and the ledger keeps it.
type charge struct {
	ID       string `json:"id"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	Source   string `json:"source"`
	Status   string `json:"status"`
}

// gatewayStats counts the provider's work: calls made to charge, and charges
// it created. Under a correct service, charges equals the operations that
// ran, however many retries and takeovers there were. Lookups are not calls.
type gatewayStats struct {
	Calls   int64 `json:"calls"`
	Charges int64 `json:"charges"`
}

// gateway is the simulated payment provider. Like a real one, it takes an
// idempotency key of its own: the first call with a key creates the charge,
// and every later call with that key returns the same charge.
type gateway interface {
	// charge counts a call, creates a charge for req unless key already has
	// one, and returns key's charge. Concurrent calls with one key agree on
	// one charge.
	charge(ctx context.Context, key string, req chargeRequest) (charge, error)
	// lookup returns key's charge, and false if no call with key has made
	// one. It charges nothing and is not counted as a call: it is how a
	// recovery learns whether a dead attempt's call reached the provider.
	lookup(ctx context.Context, key string) (charge, bool, error)
	stats(ctx context.Context) (gatewayStats, error)
}

// transactionalLedger is a ledger in the idempotency store's own database.
type transactionalLedger interface {
	// recordCompleting records c as ledger.record does and, in the same
	// transaction, stores answer as the outcome of the operation in ctx.
	recordCompleting(ctx context.Context, c charge, token uint64, answer idempotency.Response) error
}

// ledger is the service's own record of the charges it made.
type ledger interface {
	// record writes c unless an attempt with a greater fencing token has
	// written it already, in which case it returns errStale: an attempt
	// that was taken over can no longer change the ledger.
	record(ctx context.Context, c charge, token uint64) error
	// get returns the charge with the given id, or errNotFound.
	get(ctx context.Context, id string) (charge, error)
	// list returns every charge, ordered by id.
	list(ctx context.Context) ([]charge, error)
}

var (
	errStale    = errors.New("ledger: a newer attempt already wrote this charge")
	errNotFound = errors.New("ledger: no such charge")
)

func newCharge(req chargeRequest) charge {
	return charge{ID: newID("ch_"), Amount: req.Amount, Currency: req.Currency, Source: req.Source, Status: "succeeded"}
}

// respondAfter simulates the provider's latency. The charge is made before
// it: a process that dies during the wait has charged the card without
// learning so, which is exactly the window the downstream key closes.
func respondAfter(ctx context.Context, latency time.Duration) error {
	t := time.NewTimer(latency)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// Redis keys of the example's own state, beside the idempotency records.
// Keys used together share a hash tag, so that they work on a Redis Cluster.
const (
	gatewayCallsKey   = "payments:{gateway}:calls"   // a list: the downstream key of every call
	gatewayChargesKey = "payments:{gateway}:charges" // downstream key -> charge JSON
	ledgerKey         = "payments:{ledger}"          // charge id -> charge JSON
	ledgerTokensKey   = "payments:{ledger}:tokens"   // charge id -> token of its last writer
)

// recordScript writes a ledger entry unless a greater token wrote it before.
// Tokens are compared as decimal strings, since Lua numbers are doubles and
// would round tokens past 2^53.
var recordScript = redis.NewScript(`
local seen = redis.call('HGET', KEYS[2], ARGV[1])
if seen and (#seen > #ARGV[2] or (#seen == #ARGV[2] and seen > ARGV[2])) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
`)

// redisBackend is the orders, the gateway, the receipts and the ledger in
// Redis (see orders.go for the orders and the receipts).
type redisBackend struct {
	c       redis.UniversalClient
	latency time.Duration
}

func (b *redisBackend) charge(ctx context.Context, key string, req chargeRequest) (charge, error) {
	proposed, err := json.Marshal(newCharge(req))
	if err != nil {
		return charge{}, err
	}
	// MULTI/EXEC: no other call runs between the HSETNX and the HGET, so
	// the charge read is the one that won.
	var got *redis.StringCmd
	if _, err := b.c.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.RPush(ctx, gatewayCallsKey, key)
		p.HSetNX(ctx, gatewayChargesKey, key, proposed)
		got = p.HGet(ctx, gatewayChargesKey, key)
		return nil
	}); err != nil {
		return charge{}, fmt.Errorf("gateway: %w", err)
	}
	var c charge
	if err := json.Unmarshal([]byte(got.Val()), &c); err != nil {
		return charge{}, fmt.Errorf("gateway: %w", err)
	}
	return c, respondAfter(ctx, b.latency)
}

func (b *redisBackend) lookup(ctx context.Context, key string) (charge, bool, error) {
	v, err := b.c.HGet(ctx, gatewayChargesKey, key).Bytes()
	if errors.Is(err, redis.Nil) {
		return charge{}, false, nil
	}
	if err != nil {
		return charge{}, false, fmt.Errorf("gateway: %w", err)
	}
	var c charge
	if err := json.Unmarshal(v, &c); err != nil {
		return charge{}, false, fmt.Errorf("gateway: %w", err)
	}
	return c, true, nil
}

func (b *redisBackend) stats(ctx context.Context) (gatewayStats, error) {
	calls, err := b.c.LLen(ctx, gatewayCallsKey).Result()
	if err != nil {
		return gatewayStats{}, err
	}
	charges, err := b.c.HLen(ctx, gatewayChargesKey).Result()
	return gatewayStats{Calls: calls, Charges: charges}, err
}

func (b *redisBackend) record(ctx context.Context, c charge, token uint64) error {
	enc, err := json.Marshal(c)
	if err != nil {
		return err
	}
	written, err := recordScript.Run(ctx, b.c, []string{ledgerKey, ledgerTokensKey}, c.ID, token, enc).Int()
	if err != nil {
		return err
	}
	if written == 0 {
		return errStale
	}
	return nil
}

func (b *redisBackend) get(ctx context.Context, id string) (charge, error) {
	v, err := b.c.HGet(ctx, ledgerKey, id).Bytes()
	if errors.Is(err, redis.Nil) {
		return charge{}, errNotFound
	}
	if err != nil {
		return charge{}, err
	}
	var c charge
	return c, json.Unmarshal(v, &c)
}

func (b *redisBackend) list(ctx context.Context) ([]charge, error) {
	vs, err := b.c.HVals(ctx, ledgerKey).Result()
	if err != nil {
		return nil, err
	}
	charges := make([]charge, len(vs))
	for i, v := range vs {
		if err := json.Unmarshal([]byte(v), &charges[i]); err != nil {
			return nil, err
		}
	}
	slices.SortFunc(charges, func(a, b charge) int { return strings.Compare(a.ID, b.ID) })
	return charges, nil
}

// postgresSchema is the example's own tables, beside the idempotency store's.
// The gateway's calls, the orders and the receipts have a row per call.
const postgresSchema = `
CREATE TABLE IF NOT EXISTS payments_gateway_calls (
    downstream_key text        NOT NULL,
    called_at      timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS payments_gateway_charges (
    downstream_key text  PRIMARY KEY,
    charge         jsonb NOT NULL
);
CREATE TABLE IF NOT EXISTS payments_ledger (
    id     text   PRIMARY KEY,
    charge jsonb  NOT NULL,
    token  bigint NOT NULL -- the fencing token of the attempt that last wrote the row
);
CREATE TABLE IF NOT EXISTS payments_orders (
    operation text  NOT NULL, -- the idempotency operation that placed the order
    body      jsonb NOT NULL
);
CREATE INDEX IF NOT EXISTS payments_orders_operation ON payments_orders (operation);
CREATE TABLE IF NOT EXISTS payments_receipts (
    operation text  NOT NULL, -- the idempotency operation that sent the receipt
    body      jsonb NOT NULL
);
CREATE INDEX IF NOT EXISTS payments_receipts_operation ON payments_receipts (operation);`

// postgresBackend is the orders, the gateway, the receipts and the ledger in
// PostgreSQL, beside the idempotency records of store (see orders.go for the
// orders and the receipts).
type postgresBackend struct {
	pool    *pgxpool.Pool
	store   *postgres.Store
	latency time.Duration
}

// newPostgresBackend creates the example's tables if need be. Instances
// starting together take turns under an advisory lock, since concurrent
// CREATE TABLE IF NOT EXISTS can still collide.
func newPostgresBackend(ctx context.Context, pool *pgxpool.Pool, store *postgres.Store, latency time.Duration) (*postgresBackend, error) {
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('payments schema'))`); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, postgresSchema)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("creating tables: %w", err)
	}
	return &postgresBackend{pool: pool, store: store, latency: latency}, nil
}

func (b *postgresBackend) charge(ctx context.Context, key string, req chargeRequest) (charge, error) {
	// On a conflict the no-op update locks and returns the row that won,
	// committed, where DO NOTHING would return no row at all.
	var c charge
	err := b.pool.QueryRow(ctx, `
		WITH call AS (INSERT INTO payments_gateway_calls (downstream_key) VALUES ($1))
		INSERT INTO payments_gateway_charges AS g (downstream_key, charge) VALUES ($1, $2)
		ON CONFLICT (downstream_key) DO UPDATE SET charge = g.charge
		RETURNING charge`, key, newCharge(req)).Scan(&c)
	if err != nil {
		return charge{}, fmt.Errorf("gateway: %w", err)
	}
	return c, respondAfter(ctx, b.latency)
}

func (b *postgresBackend) lookup(ctx context.Context, key string) (charge, bool, error) {
	var c charge
	err := b.pool.QueryRow(ctx, `SELECT charge FROM payments_gateway_charges WHERE downstream_key = $1`, key).Scan(&c)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return charge{}, false, nil
	case err != nil:
		return charge{}, false, fmt.Errorf("gateway: %w", err)
	}
	return c, true, nil
}

func (b *postgresBackend) stats(ctx context.Context) (gatewayStats, error) {
	var s gatewayStats
	err := b.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM payments_gateway_calls),
		(SELECT count(*) FROM payments_gateway_charges)`).Scan(&s.Calls, &s.Charges)
	return s, err
}

func (b *postgresBackend) record(ctx context.Context, c charge, token uint64) error {
	return recordIn(ctx, b.pool, c, token)
}

// recordCompleting records c and completes the operation in ctx with answer
// in one transaction: the ledger holds the charge if and only if its
// idempotency record holds the answer.
func (b *postgresBackend) recordCompleting(ctx context.Context, c charge, token uint64, answer idempotency.Response) error {
	// Committed with the operation's context: a transaction still open when
	// the lease ends locally rolls back.
	return pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		if err := recordIn(ctx, tx, c, token); err != nil {
			return err
		}
		return b.store.CompleteTx(ctx, tx, answer)
	})
}

// execer is a pool or a transaction.
type execer interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}

// recordIn writes c to the ledger through q.
func recordIn(ctx context.Context, q execer, c charge, token uint64) error {
	tag, err := q.Exec(ctx, `
		INSERT INTO payments_ledger AS l (id, charge, token) VALUES ($1, $2, $3)
		ON CONFLICT (id) DO UPDATE SET charge = excluded.charge, token = excluded.token
		WHERE l.token <= excluded.token`, c.ID, c, int64(token))
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 0 {
		return errStale
	}
	return nil
}

func (b *postgresBackend) get(ctx context.Context, id string) (charge, error) {
	var c charge
	err := b.pool.QueryRow(ctx, `SELECT charge FROM payments_ledger WHERE id = $1`, id).Scan(&c)
	if errors.Is(err, pgx.ErrNoRows) {
		return charge{}, errNotFound
	}
	return c, err
}

func (b *postgresBackend) list(ctx context.Context) ([]charge, error) {
	rows, _ := b.pool.Query(ctx, `SELECT charge FROM payments_ledger ORDER BY id`)
	return pgx.CollectRows(rows, pgx.RowTo[charge])
}
