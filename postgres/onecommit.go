package postgres

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/storeerr"
	"github.com/idempotency-go/idempotency/internal/wire"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// OneCommit is the one-commit mode of a Store: an idempotency.Transactor
// that claims a key, runs the operation and stores its outcome in one
// transaction, so that the operation's own writes in that transaction
// (TxFromContext) and its record commit together, with one commit, or
// roll back together. A crash, a lost connection, an error or a panic
// leaves nothing behind: no record in flight to recover, and the retry runs
// the operation once. Use it when the operation's effects live in the same
// database; an operation that acts outside it (a card charged at a
// provider) needs the lease mode, the Store itself, whose record outlives
// a crash.
//
// It shares the Store's table, so one deployment may use both modes, and
// every other method is the Store's (Stats, Inspect, ListInFlight,
// ListAbandoned, DeleteExpired, the operator command): a record of this
// mode is never seen in flight, since it exists for others only once it is
// committed completed. A claim of the lease mode on a key this mode holds
// waits for its transaction on the row's lock, within the lease mode's
// ClaimTimeout. A record of the lease mode in flight, abandoned or released
// is not taken over here: Transact answers ErrInFlight, and the lease mode
// (a retry through it, or a sweep) must settle it.
//
// The record is written completed from its insert, with its expiry, and
// stays out of the index of records in flight; the completion only sets
// its response, which no index covers, so it can stay on the page (HOT).
type OneCommit struct {
	*Store
	insertSQL, readSQL, remakeSQL, completeSQL string
	// answered is how often recent claims were answered from a committed
	// record (a replay or a mismatch) rather than owning the key.
	answered share
}

var (
	_ idempotency.Store      = (*OneCommit)(nil)
	_ idempotency.Transactor = (*OneCommit)(nil)
)

// OneCommit returns the one-commit mode of s, on s's pool and table.
func (s *Store) OneCommit() *OneCommit {
	t := newNames(s.opts.Table).Table
	retention := `now() + $5::bigint * interval '1 microsecond'`
	// The settings of the transaction, $6 and $7, are made before a row is
	// written: a lock it then waits for is bounded by them.
	settings := `(SELECT set_config('lock_timeout', $6, true), set_config('idle_in_transaction_session_timeout', $7, true)) settings`
	return &OneCommit{
		Store: s,
		// Written completed, lease_until now(): out of the partial index of
		// records in flight, and invisible to all until it commits.
		insertSQL: `INSERT INTO ` + t + ` AS t (scope, key, fingerprint, state, attempt, operation_id, lease_until, expires_at)
			SELECT $1::text, $2::text, $3::bytea, 'completed', 1, $4::text, now(), ` + retention + ` FROM ` + settings + `
			ON CONFLICT (scope, key) DO NOTHING RETURNING t.token`,
		readSQL: `SELECT state, fingerprint, operation_id, response, expires_at > now() FROM ` + t + `
			WHERE scope = $1 AND key = $2`,
		// An expired row that DeleteExpired has not deleted yet counts as
		// absent: it is made anew in place, under the row's lock.
		remakeSQL: `UPDATE ` + t + ` t SET fingerprint = $3, state = 'completed', token = DEFAULT, attempt = 1,
				operation_id = $4, lease_until = now(), response = NULL, points = NULL, waiters = false,
				created_at = now(), expires_at = ` + retention + `
			FROM ` + settings + `
			WHERE scope = $1 AND key = $2 AND expires_at <= now() RETURNING token`,
		// Only response changes: no indexed column, so a HOT update.
		completeSQL: `UPDATE ` + t + ` SET response = $3 WHERE scope = $1 AND key = $2 AND token = $4`,
	}
}

type txKey struct{}

// TxFromContext returns the transaction of the one-commit operation running
// in ctx, for the operation's own reads and writes, which commit with its
// record or not at all. Its Commit and Rollback fail: the store ends it,
// and an operation rolls it back by returning an error. Begin makes a
// savepoint, which the operation may commit or roll back.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(pgx.Tx)
	return tx, ok
}

// Transact implements idempotency.Transactor. The transaction runs at READ
// COMMITTED, whatever the server's default: a duplicate's insert waits on
// the owner's uncommitted row, and its next statement then reads the row
// committed. Its lock_timeout is wait, after which a duplicate gets
// ErrInFlight. Its idle_in_transaction_session_timeout is req.Lease, so the
// server ends the transaction of an owner that stalls (a pause, a
// partition) for a lease between statements, and that owner's commit
// fails. An operation that spends longer than the lease between two
// statements of its transaction is ended so too.
//
// A new operation takes two round trips besides its own statements (the
// claim, the answer with COMMIT); a replay or a mismatch two (the claim,
// then the read of the committed record with ROLLBACK). While most recent
// claims were answered from a committed record (a retry storm), Transact
// reads the key's committed record first, outside any transaction: a
// replay or a mismatch then takes one round trip and waits for no writer
// of the row, and a new operation three.
func (oc *OneCommit) Transact(ctx context.Context, req idempotency.ClaimRequest, wait time.Duration,
	op func(ctx context.Context, c idempotency.Claim) (idempotency.Response, bool, error)) (idempotency.Claim, error) {
	conn, err := oc.pool.Acquire(ctx)
	if err != nil {
		return idempotency.Claim{}, storeerr.Unavailable("postgres one-commit", err)
	}
	// A connection released inside a transaction, or broken, is closed by
	// the pool rather than reused.
	defer conn.Release()
	var (
		c  idempotency.Claim
		tx pgx.Tx
	)
	defer func() {
		if tx != nil && conn.Conn().PgConn().TxStatus() != 'I' {
			rollback(ctx, tx)
		}
	}()
	// The claim's round trip and the commit's are bounded by their
	// context besides the server's settings, so that a silent connection
	// fails them (ErrUnavailable) rather than hold the caller: the claim
	// by the wait and a lease, the commit by a lease.
	bound := max(req.Lease, time.Second)
	cctx, cancel := context.WithTimeout(ctx, max(wait, 0)+bound)
	c, tx, err = oc.claim(cctx, conn.Conn(), req, wait)
	cancel()
	if err == nil {
		oc.answered.add(c.State != idempotency.Owner)
	}
	if err != nil || c.State != idempotency.Owner {
		return c, err
	}
	resp, keep, err := op(context.WithValue(ctx, txKey{}, pgx.Tx(opTx{tx})), c)
	if err != nil || !keep {
		return c, err
	}
	cctx, cancel = context.WithTimeout(ctx, bound)
	defer cancel()
	return c, oc.complete(cctx, conn, tx, req.Key, c.Token, resp)
}

// millis is d in whole milliseconds, at least 1, as a setting: 0 would
// turn lock_timeout or idle_in_transaction_session_timeout off.
func millis(d time.Duration) string {
	return strconv.FormatInt(max(int64((d+time.Millisecond-1)/time.Millisecond), 1), 10)
}

// idle is the idle_in_transaction_session_timeout of a lease: none for
// none.
func idle(lease time.Duration) string {
	if lease <= 0 {
		return "0"
	}
	return millis(lease)
}

// rollback ends tx, even once ctx is done. A rollback that fails closes
// the connection.
func rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	_ = tx.Rollback(rctx)
}

// claim claims req.Key in a transaction it begins on conn, waiting at most
// wait. It returns the transaction, which the caller ends unless claim
// did: a replay or a mismatch has none left. A new record takes one round
// trip, an answer from a committed record two (see write and read), or one
// while most claims are answered so (see answer).
func (oc *OneCommit) claim(ctx context.Context, conn *pgx.Conn, req idempotency.ClaimRequest, wait time.Duration) (idempotency.Claim, pgx.Tx, error) {
	if oc.answered.most() {
		if c, ok, err := oc.answer(ctx, conn, req); ok || err != nil {
			return c, nil, err
		}
	}
	// A row read expired, or gone, is claimed again; each time, another
	// claim made or removed the key's record in between.
	for range 3 {
		tx, token, err := oc.write(ctx, conn, oc.insertSQL, req, wait)
		if err != nil || token != 0 {
			return owner(req, token, err), tx, err
		}
		r, err := oc.read(ctx, tx, req.Key)
		switch {
		case err != nil:
			return idempotency.Claim{}, tx, err
		case r.live:
			c, err := r.decide(req)
			return c, tx, err
		case r.found:
			if tx, token, err = oc.write(ctx, conn, oc.remakeSQL, req, wait); err != nil || token != 0 {
				return owner(req, token, err), tx, err
			}
			// No longer expired, or gone.
			if err := tx.Rollback(ctx); err != nil {
				return idempotency.Claim{}, tx, claimError(err)
			}
		}
	}
	return idempotency.Claim{}, nil, fmt.Errorf("%w: postgres one-commit: the key's record changed under three claims", idempotency.ErrInFlight)
}

// write begins a transaction and runs sql, the insert or the remake of
// req's record, in it, in one round trip, and returns the record's token,
// or 0 when sql wrote no row. sql sets the transaction's lock_timeout and
// idle_in_transaction_session_timeout before it writes, so that its wait
// on the row of a transaction in flight for the key is bounded.
func (oc *OneCommit) write(ctx context.Context, conn *pgx.Conn, sql string, req idempotency.ClaimRequest, wait time.Duration) (pgx.Tx, int64, error) {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	b.Queue(sql, req.Key.Scope, req.Key.Name, req.Fingerprint[:], req.OperationID, req.Retention.Microseconds(),
		millis(wait), idle(req.Lease))
	br := conn.SendBatch(ctx, b)
	tx := br.Tx()
	_, err := br.Exec()
	var token int64
	if err == nil {
		err = br.QueryRow().Scan(&token)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		err = nil
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return tx, token, claimError(err)
}

// read reads the key's row, committed, and ends tx, in one round trip.
func (oc *OneCommit) read(ctx context.Context, tx pgx.Tx, k idempotency.Key) (oneCommitRow, error) {
	b := &pgx.Batch{}
	b.Queue(oc.readSQL, k.Scope, k.Name)
	b.Queue("ROLLBACK")
	br := tx.SendBatch(ctx, b)
	r, err := scanRow(br.QueryRow())
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return r, claimError(err)
}

// answer answers req from the key's committed record, read in one round
// trip outside any transaction, as a claim at the moment of the read would
// (see decide), without waiting for a transaction that writes the row: ok
// is false when the key has no live record, which only a claim can settle.
func (oc *OneCommit) answer(ctx context.Context, conn *pgx.Conn, req idempotency.ClaimRequest) (c idempotency.Claim, ok bool, err error) {
	r, err := scanRow(conn.QueryRow(ctx, oc.readSQL, req.Key.Scope, req.Key.Name))
	if err != nil || !r.live {
		return idempotency.Claim{}, false, claimError(err)
	}
	c, err = r.decide(req)
	return c, true, err
}

// scanRow scans a row of readSQL: found is false, with no error, when the
// key has none.
func scanRow(row pgx.Row) (oneCommitRow, error) {
	var r oneCommitRow
	err := row.Scan(&r.state, &r.fingerprint, &r.operationID, &r.response, &r.live)
	r.found = err == nil
	if errors.Is(err, pgx.ErrNoRows) {
		err = nil
	}
	return r, err
}

// claimError is err as a claim's: a wait that ran out is ErrInFlight, any
// other failure ErrUnavailable.
func claimError(err error) error {
	switch {
	case err == nil:
		return nil
	case lockTimedOut(err):
		return fmt.Errorf("%w: postgres one-commit: the key's transaction outlasted the wait: %w", idempotency.ErrInFlight, err)
	}
	return storeerr.Unavailable("postgres one-commit claim", err)
}

// owner is the claim of the record made for req with token, or none after
// err.
func owner(req idempotency.ClaimRequest, token int64, err error) idempotency.Claim {
	if err != nil {
		return idempotency.Claim{}
	}
	return idempotency.Claim{State: idempotency.Owner, OperationID: req.OperationID, Attempt: 1, Token: uint64(token)}
}

// oneCommitRow is the committed row of a key a one-commit claim found.
type oneCommitRow struct {
	state       string
	fingerprint []byte
	operationID string
	response    []byte
	found       bool // the key has a row
	live        bool // found and not expired
}

// decide answers req from r, a live row of another request or attempt: a
// replay, a mismatch, or, for a record of the lease mode not completed,
// ErrInFlight. A row no statement writes fails as readRow.decide fails it.
func (r oneCommitRow) decide(req idempotency.ClaimRequest) (idempotency.Claim, error) {
	var err error
	switch {
	case !knownState(r.state):
		err = fmt.Errorf("unknown record state %q", r.state)
	case string(r.fingerprint) != string(req.Fingerprint[:]):
		return idempotency.Claim{State: idempotency.Mismatch}, nil
	case r.state != "completed":
		return idempotency.Claim{}, fmt.Errorf("%w: postgres one-commit: the key's record is %s in the lease mode", idempotency.ErrInFlight, r.state)
	case r.operationID == "":
		err = errors.New("completed record of no operation ID")
	default:
		c := idempotency.Claim{State: idempotency.Completed, OperationID: r.operationID}
		c.Response.Status, c.Response.Header, c.Response.Body, err = wire.ParseResponse(r.response)
		if err == nil {
			return c, nil
		}
	}
	return idempotency.Claim{}, storeerr.Unavailable("postgres one-commit claim", err)
}

// complete stores resp in the record of k made with token and commits tx,
// in one round trip. A commit the server refuses (the transaction was ended
// for its idleness, or failed) stores nothing.
func (oc *OneCommit) complete(ctx context.Context, conn *pgxpool.Conn, tx pgx.Tx, k idempotency.Key, token uint64, resp idempotency.Response) error {
	b := &pgx.Batch{}
	b.Queue(oc.completeSQL, k.Scope, k.Name, wire.AppendResponse(nil, resp.Status, resp.Header, resp.Body), int64(token))
	b.Queue("COMMIT")
	br := tx.SendBatch(ctx, b)
	tag, err := br.Exec()
	if err == nil && tag.RowsAffected() != 1 {
		err = fmt.Errorf("the completion found %d rows", tag.RowsAffected())
	}
	var commit pgconn.CommandTag
	if err == nil {
		commit, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil && commit.String() != "COMMIT" {
		err = fmt.Errorf("the transaction ended with %s", commit)
	}
	if err != nil {
		// Ended or not, the connection is left to the pool to close.
		if conn.Conn().PgConn().TxStatus() != 'I' {
			rollback(ctx, tx)
		}
		return storeerr.Unavailable("postgres one-commit complete", err)
	}
	return nil
}

// lockTimedOut reports that err is the lock_timeout's: lock_not_available.
func lockTimedOut(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "55P03"
}
