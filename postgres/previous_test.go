package postgres_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/wire"
	"github.com/idempotency-go/idempotency/postgres"
)

// previousStore sends the statements an instance of the previous version
// sends, verbatim: its claim statement, which reads the row and calls the
// claim function, and one function call per owner's write. It waits and
// lists through a Store of this version, whose listener and reads the
// previous version shares.
type previousStore struct {
	*postgres.Store
	pool  *pgxpool.Pool
	table string
}

func newPreviousStore(pool *pgxpool.Pool, s *postgres.Store, o postgres.Options) *previousStore {
	return &previousStore{Store: s, pool: pool, table: o.Table}
}

// fn is the quoted name of the table's function of suffix.
func (p *previousStore) fn(suffix string) string { return pgx.Identifier{p.table + suffix}.Sanitize() }

// claimSQL is the previous version's claim statement.
func (p *previousStore) claimSQL() string {
	return `WITH cur AS (
			SELECT state, fingerprint, operation_id, response, waiters,
				CASE WHEN state = 'in_progress' AND lease_until > now()
					THEN (extract(epoch FROM lease_until - now()) * 1000000)::bigint END AS lease_left_us
			FROM ` + pgx.Identifier{p.table}.Sanitize() + ` WHERE scope = $1 AND key = $2 AND expires_at > now()
		), read AS (
			SELECT CASE WHEN fingerprint <> $3 THEN 'mismatch' WHEN state = 'completed' THEN 'completed' ELSE 'in_flight' END AS o_state,
				operation_id, response, lease_left_us
			FROM cur WHERE fingerprint <> $3 OR state = 'completed' OR (lease_left_us IS NOT NULL AND (NOT $7 OR waiters))
		)
		SELECT o_state, CASE WHEN o_state = 'completed' THEN operation_id ELSE '' END, 0, 0::bigint,
			CASE WHEN o_state = 'completed' THEN response END,
			CASE WHEN o_state = 'in_flight' THEN lease_left_us ELSE 0 END, false
		FROM read
		UNION ALL
		SELECT o_state, coalesce(o_operation_id, ''), coalesce(o_attempt, 0), coalesce(o_token, 0), o_response,
			coalesce(o_lease_left_us, 0), coalesce(o_abandoned, false)
		FROM ` + p.fn("_claim") + `($1, $2, $3, $4, $5, $6, $7) WHERE NOT EXISTS (SELECT FROM read)`
}

func (p *previousStore) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	var (
		state, op     string
		attempt       int
		token, leftUS int64
		response      []byte
		abandoned     bool
		c             idempotency.Claim
		err           error
	)
	err = p.pool.QueryRow(ctx, p.claimSQL(), req.Key.Scope, req.Key.Name, req.Fingerprint[:], req.OperationID,
		req.Lease.Microseconds(), req.Retention.Microseconds(), req.Watch).
		Scan(&state, &op, &attempt, &token, &response, &leftUS, &abandoned)
	if err != nil {
		return c, fmt.Errorf("%w: previous claim: %w", idempotency.ErrUnavailable, err)
	}
	c = idempotency.Claim{OperationID: op, Attempt: attempt, Abandoned: abandoned}
	switch state {
	case "owner":
		c.State, c.Token = idempotency.Owner, uint64(token)
	case "completed":
		c.State = idempotency.Completed
		c.Response.Status, c.Response.Header, c.Response.Body, err = wire.ParseResponse(response)
	case "in_flight":
		c.State, c.LeaseLeft = idempotency.InFlight, time.Duration(leftUS)*time.Microsecond
	case "mismatch":
		c.State = idempotency.Mismatch
	default:
		err = fmt.Errorf("claim state %q", state)
	}
	if err != nil {
		return idempotency.Claim{}, fmt.Errorf("%w: previous claim: %w", idempotency.ErrUnavailable, err)
	}
	return c, nil
}

// call runs the previous version's call of the owner's function of suffix
// with args after the key and the token.
func (p *previousStore) call(ctx context.Context, suffix string, k idempotency.Key, token uint64, args ...any) error {
	args = append([]any{k.Scope, k.Name, int64(token)}, args...)
	marks := make([]string, len(args))
	for i := range args {
		marks[i] = fmt.Sprintf("$%d", i+1)
	}
	var changed bool
	err := p.pool.QueryRow(ctx, "SELECT "+p.fn(suffix)+"("+strings.Join(marks, ", ")+")", args...).Scan(&changed)
	switch {
	case err != nil:
		return fmt.Errorf("%w: previous %s: %w", idempotency.ErrUnavailable, suffix, err)
	case !changed:
		return fmt.Errorf("previous %s: %w", suffix, idempotency.ErrFenced)
	}
	return nil
}

func (p *previousStore) Complete(ctx context.Context, k idempotency.Key, token uint64, resp idempotency.Response, retention time.Duration) error {
	return p.call(ctx, "_complete", k, token, wire.AppendResponse(nil, resp.Status, resp.Header, resp.Body), retention.Microseconds(), false)
}

func (p *previousStore) Release(ctx context.Context, k idempotency.Key, token uint64) error {
	return p.call(ctx, "_release", k, token)
}

func (p *previousStore) Forget(ctx context.Context, k idempotency.Key, token uint64) error {
	return p.call(ctx, "_forget", k, token)
}

func (p *previousStore) Heartbeat(ctx context.Context, k idempotency.Key, token uint64, lease time.Duration) error {
	return p.call(ctx, "_heartbeat", k, token, lease.Microseconds())
}

func (p *previousStore) Abandon(ctx context.Context, k idempotency.Key, token uint64) error {
	return p.call(ctx, "_heartbeat", k, token, int64(0))
}

func (p *previousStore) SaveRecoveryPoint(ctx context.Context, k idempotency.Key, token uint64, pt idempotency.RecoveryPoint) error {
	return p.call(ctx, "_point", k, token, wire.AppendPoint(nil, pt.Step, pt.Result), false)
}

// mixedStore sends each call, at random, as this version's Store or as the
// previous version's: the instances of a rolling upgrade, one record's
// calls split among them.
type mixedStore struct {
	*postgres.Store
	previous *previousStore
}

// pick is the store the next call goes to.
func (m *mixedStore) pick() interface {
	idempotency.Store
	idempotency.RecoveryPointStore
} {
	if rand.IntN(2) == 0 {
		return m.previous
	}
	return m.Store
}

func (m *mixedStore) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	return m.pick().Claim(ctx, req)
}

func (m *mixedStore) Complete(ctx context.Context, k idempotency.Key, token uint64, resp idempotency.Response, retention time.Duration) error {
	return m.pick().Complete(ctx, k, token, resp, retention)
}

func (m *mixedStore) Release(ctx context.Context, k idempotency.Key, token uint64) error {
	return m.pick().Release(ctx, k, token)
}

func (m *mixedStore) Forget(ctx context.Context, k idempotency.Key, token uint64) error {
	return m.pick().Forget(ctx, k, token)
}

func (m *mixedStore) Heartbeat(ctx context.Context, k idempotency.Key, token uint64, lease time.Duration) error {
	return m.pick().Heartbeat(ctx, k, token, lease)
}

func (m *mixedStore) Abandon(ctx context.Context, k idempotency.Key, token uint64) error {
	return m.pick().Abandon(ctx, k, token)
}

func (m *mixedStore) SaveRecoveryPoint(ctx context.Context, k idempotency.Key, token uint64, pt idempotency.RecoveryPoint) error {
	return m.pick().SaveRecoveryPoint(ctx, k, token, pt)
}
