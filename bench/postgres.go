package main

import (
	"context"
	crand "crypto/rand"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/postgres"
)

// The PostgreSQL floors are the seeds' naive table, as a team replacing it
// with this library's store would have it: a claim by INSERT … ON CONFLICT
// DO NOTHING, a completion by UPDATE, a replay by one SELECT, each one
// autocommitted statement through pgx with its default statement cache.
const (
	pgTwoStatements = "baseline/postgres-two-statements"
	pgOneSelect     = "baseline/postgres-select"
	pgReplayOp      = "postgres/replay"
)

const naiveTable = `CREATE TABLE IF NOT EXISTS bench_naive_keys (
    key           text PRIMARY KEY,
    request_hash  bytea NOT NULL,
    status_code   integer,
    response_body bytea,
    completed     boolean NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL DEFAULT now()
)`

// onPostgres reports that the row of name runs on PostgreSQL, whose server
// is another process: the library's rows and their floors.
func onPostgres(name string) bool {
	return strings.HasPrefix(name, "postgres/") || strings.HasPrefix(name, "baseline/postgres")
}

// naive runs the floors on pool, in the table naiveTable makes.
type naive struct{ pool *pgxpool.Pool }

// newOperation is the floor of a new operation: the two statements of the
// seeds' middleware on a fresh key.
func (n naive) newOperation(ctx context.Context, key string) error {
	var claimed string
	err := n.pool.QueryRow(ctx, `INSERT INTO bench_naive_keys (key, request_hash) VALUES ($1, $2)
		ON CONFLICT (key) DO NOTHING RETURNING key`, key, fp[:]).Scan(&claimed)
	if err != nil {
		return err
	}
	_, err = n.pool.Exec(ctx, `UPDATE bench_naive_keys SET status_code = $2, response_body = $3, completed = true
		WHERE key = $1`, key, created.Status, created.Body)
	return err
}

// replay is the floor of a replay: one SELECT of a completed key.
func (n naive) replay(ctx context.Context, key string) error {
	var (
		hash, body []byte
		status     int
		completed  bool
	)
	err := n.pool.QueryRow(ctx, `SELECT request_hash, status_code, response_body, completed
		FROM bench_naive_keys WHERE key = $1`, key).Scan(&hash, &status, &body, &completed)
	if err == nil && !completed {
		err = errors.New("a completed key read as in flight")
	}
	return err
}

// pgTwoStatementsRow is the floor of postgres/new-operation.
func (e *env) pgTwoStatementsRow(_ context.Context, prefix string) (timedOp, error) {
	if e.pgNaive == nil {
		return nil, skipped(e.pgSkip)
	}
	return timed(func(ctx context.Context, w, i int) error { return e.pgNaive.newOperation(ctx, freshKey(prefix, w, i)) }), nil
}

// pgOneSelectRow is the floor of postgres/replay, over as many completed
// keys as the replay rows read.
func (e *env) pgOneSelectRow(ctx context.Context, prefix string) (timedOp, error) {
	if e.pgNaive == nil {
		return nil, skipped(e.pgSkip)
	}
	names := keyNames(prefix)
	err := each(ctx, len(names), e.concurrency, func(ctx context.Context, n int) error {
		return e.pgNaive.newOperation(ctx, names[n])
	})
	return timed(func(ctx context.Context, w, i int) error { return e.pgNaive.replay(ctx, names[pick(w, i)]) }), err
}

// pgRecordBytes completes records records whose response is resp, under
// 36-byte key names, in a table of their own, and returns the table's size
// with its indexes and TOAST (pg_total_relation_size) per record, after a
// VACUUM, which it then drops. The table's fillfactor leaves a fifth of
// each page free, as the store's does.
func pgRecordBytes(ctx context.Context, pool *pgxpool.Pool, resp idempotency.Response, records, concurrency int) (int64, error) {
	var p [4]byte
	_, _ = crand.Read(p[:])
	table := fmt.Sprintf("bench_size_%x", p)
	s := postgres.New(pool, postgres.Options{Table: table, Channel: table})
	defer s.Close()
	if err := s.Migrate(ctx); err != nil {
		return 0, err
	}
	defer func() {
		_, _ = pool.Exec(context.WithoutCancel(ctx), "DROP TABLE "+table+" CASCADE")
		for _, f := range []string{"_claim", "_complete", "_release", "_forget", "_heartbeat", "_point", "_wake"} {
			_, _ = pool.Exec(context.WithoutCancel(ctx), "DROP FUNCTION IF EXISTS "+table+f+" CASCADE")
		}
	}()
	err := each(ctx, records, concurrency, func(ctx context.Context, n int) error {
		k := idempotency.Key{Name: fmt.Sprintf("%036d", n)}
		c, err := s.Claim(ctx, idempotency.ClaimRequest{Key: k, Fingerprint: fp, OperationID: fmt.Sprintf("op_%026d", n),
			Lease: time.Minute, Retention: retention})
		if err == nil {
			err = s.Complete(ctx, k, c.Token, resp, retention)
		}
		return err
	})
	if err != nil {
		return 0, err
	}
	if _, err := pool.Exec(ctx, "VACUUM "+table); err != nil {
		return 0, err
	}
	var bytes int64
	err = pool.QueryRow(ctx, "SELECT pg_total_relation_size($1)", table).Scan(&bytes)
	return bytes / int64(records), err
}
