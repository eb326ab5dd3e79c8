// Package postgres is an idempotency.Store on PostgreSQL 15 or later,
// through pgx. It has the contract of every store (see idempotency.Store),
// keeps the recovery points of idempotency.Step (it is an
// idempotency.RecoveryPointStore), and does two things more inside the
// caller's transaction, so that a business write and the store's write
// commit together or not at all: CompleteTx completes a record, and StepTx
// records a step.
//
// Leases and retention are judged by the database's clock (now()), never by
// the application servers'. Run Migrate once at start-up, and DeleteExpired
// on a schedule.
package postgres

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"text/template"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/storeerr"
	"github.com/idempotency-go/idempotency/internal/wakeup"
	"github.com/idempotency-go/idempotency/internal/wire"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Options configures a Store. The zero value of every field is its
// documented default.
type Options struct {
	// Table is the table of records, schema-qualified with a dot if need be
	// ("app.idempotency_records"). The indexes, functions and triggers that
	// Migrate creates are named after it. Default "idempotency_records".
	Table string
	// Channel is the LISTEN/NOTIFY channel on which settling a record wakes
	// its waiters. Migrate writes it into the table's trigger, so every
	// Store on one table must use the same Channel. Default
	// "idempotency_wake".
	Channel string
}

// promptClaim is the longest a claim may take from its start to its
// insertion of a new record and keep the token it drew there (see the claim
// function in schema.sql); DeleteExpired leaves a record twice as long after
// it expired, or was forgotten, which is what keeps tokens growing.
const promptClaim = time.Second

// deleteBatch bounds the rows one DeleteExpired statement deletes, so that
// no transaction holds many row locks or runs for long.
const deleteBatch = 10000

// Listener reconnection backs off from the first delay, doubling up to the
// last.
const (
	minReconnectDelay = 50 * time.Millisecond
	maxReconnectDelay = 5 * time.Second
)

// listenPing is how long the listening connection may stay silent before it
// is pinged. A ping, or a connection and its LISTEN, unanswered for as long
// again counts as failed: a connection gone silent (a dropped NAT entry, a
// hung load balancer) is replaced, and every subscriber woken, within twice
// this, rather than when TCP keepalive gives up on it many minutes later.
const listenPing = 3 * time.Second

// Store is an idempotency.Store on PostgreSQL. It is safe for concurrent use.
// Stores in many processes that share a database and Options act as one.
type Store struct {
	pool *pgxpool.Pool
	opts Options
	// endsByDeadline: pgx ends every call of the pool by its context's
	// deadline (see EndsByDeadline).
	endsByDeadline bool
	// prepares: the pool's connections keep prepared statements.
	prepares bool
	// pooled runs an owner's statement on a connection of the pool.
	pooled onConn
	// The table's statements, with its quoted name filled in.
	claimSQL, claimFunctionSQL                                 string
	abandonedSQL, statsSQL, deleteSQL, inspectSQL, inflightSQL string
	// The owner's statements (see prepared.go).
	complete, release, forget, heartbeat *ownerStatement
	point, points                        *ownerStatement

	mu   sync.Mutex
	subs wakeup.Registry[string] // by wakeID
	// listening is closed while the listener's connection has executed
	// LISTEN; it is replaced by an open one when that connection is lost.
	listening chan struct{}
	up        bool  // listening is closed
	listenErr error // why the listener last lost or failed to get a connection
	stop      context.CancelFunc
	stopped   chan struct{} // closed when the listener goroutine has ended
	closed    bool
}

var (
	_ idempotency.Store              = (*Store)(nil)
	_ idempotency.RecoveryPointStore = (*Store)(nil)
	_ idempotency.DeadlineBound      = (*Store)(nil)
	_ idempotency.Inspector          = (*Store)(nil)
)

// New returns a Store that keeps its records in pool's database. Call
// Migrate before first use, and Close when done with the Store.
func New(pool *pgxpool.Pool, o Options) *Store {
	if o.Table == "" {
		o.Table = "idempotency_records"
	}
	if o.Channel == "" {
		o.Channel = "idempotency_wake"
	}
	n := newNames(o.Table)
	t := n.Table
	// An owner's write: $1, $2 and $3 are the key and the token, the rest
	// as its parameters set them.
	owner := func(name string, set func(*params), oids ...uint32) *ownerStatement {
		return newOwnerStatement(render(n, name, ownerParams(set)), oids...)
	}
	none := func(*params) {}
	grace := interval(2 * promptClaim)
	s := &Store{
		pool:             pool,
		opts:             o,
		endsByDeadline:   deadlineHandled(pool),
		prepares:         prepares(pool.Config().ConnConfig),
		claimSQL:         claimSQL(n),
		claimFunctionSQL: claimFunctionSQL(n),
		complete: owner("complete", func(p *params) { p.Response, p.RetentionUS, p.InTx = "$4", "$5", "$6" },
			pgtype.ByteaOID, pgtype.Int8OID, pgtype.BoolOID),
		release:   owner("release", none),
		forget:    owner("forget", none),
		heartbeat: owner("heartbeat", func(p *params) { p.LeaseUS = "$4" }, pgtype.Int8OID),
		point:     owner("point", func(p *params) { p.Entry, p.InTx = "$4", "$5" }, pgtype.ByteaOID, pgtype.BoolOID),
		points:    newOwnerStatement(pointsSQL(n)),
		// The partial index on lease_until holds the records in flight only,
		// so the scan's cost follows them, not every record kept. Records
		// past retention still in it (until DeleteExpired) are filtered out.
		abandonedSQL: `SELECT scope, key, fingerprint FROM ` + t + `
			WHERE state = 'in_progress' AND lease_until <= now() AND expires_at > now()
			ORDER BY lease_until LIMIT $1`,
		// On the same partial index: its cost follows the records in flight.
		statsSQL: `SELECT count(*) FILTER (WHERE lease_until > now()), count(*) FILTER (WHERE lease_until <= now())
			FROM ` + t + ` WHERE state = 'in_progress' AND expires_at > now()`,
		// The rows are locked before they are deleted, and rows that a claim
		// holds are skipped: a claim making a new record in place of an
		// expired one is never undone, nor waited for. A row is deleted
		// twice promptClaim after it expired or, if it was forgotten, after
		// it was forgotten.
		deleteSQL: `DELETE FROM ` + t + ` t USING (
				SELECT scope, key FROM ` + t + ` WHERE expires_at <= now() - ` + grace + `
					AND created_at <= now() - ` + grace + ` LIMIT $1 FOR UPDATE SKIP LOCKED
			) doomed WHERE t.scope = doomed.scope AND t.key = doomed.key`,
		inspectSQL: `SELECT ` + inspected + ` FROM ` + t + ` t WHERE scope = $1 AND key = $2 AND expires_at > now()`,
		// On the partial index of the records in flight, from a cursor on.
		inflightSQL: `SELECT ` + inspected + ` FROM ` + t + ` t
			WHERE state = 'in_progress' AND expires_at > now() AND (lease_until, scope, key) > ($1, $2, $3)
			ORDER BY lease_until, scope, key LIMIT $4`,
		listening: make(chan struct{}),
	}
	s.pooled = onConn{with: s.withPooled}
	return s
}

// inspected is what Inspect and ListInFlight read of a row, the times as
// microseconds from the database's now().
const inspected = `scope, key, state, operation_id, fingerprint, attempt, token, response,
	(extract(epoch FROM lease_until - now()) * 1000000)::bigint,
	(extract(epoch FROM expires_at - now()) * 1000000)::bigint,
	(extract(epoch FROM now() - created_at) * 1000000)::bigint,
	(extract(epoch FROM lease_until) * 1000000)::bigint,
	` + rowPoints

// EndsByDeadline implements idempotency.DeadlineBound: it vouches for a pool
// whose connections keep pgx's default handling of a context that ends, a
// deadline set on the connection at once, so that every call returns by its
// context's deadline however silent the server. A pool configured with
// another handler (one that waits, or cancels on the server first) gets no
// vouch, and a Guard settles records on a goroutine of its own.
func (s *Store) EndsByDeadline(as idempotency.Store) bool {
	return as == idempotency.Store(s) && s.endsByDeadline
}

// deadlineHandled reports whether pool's connections set a deadline on the
// connection as soon as a call's context ends, as pgx does by default: it
// builds the handler for a connection not yet made, and a builder that
// cannot (it panics) is taken for one that does not.
func deadlineHandled(pool *pgxpool.Pool) (ok bool) {
	build := pool.Config().ConnConfig.BuildContextWatcherHandler
	if build == nil {
		return false
	}
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	h, isDeadline := build(&pgconn.PgConn{}).(*pgconn.DeadlineContextWatcherHandler)
	return isDeadline && h.DeadlineDelay <= 0
}

// names are the quoted names of the objects Migrate creates for a table.
type names struct {
	Table, Claim, Create, Wake     string // schema-qualified
	Complete, Release, Forget      string // schema-qualified
	Heartbeat, Point               string // schema-qualified
	ExpiresIndex, LeaseIndex       string // in the table's schema
	SettledTrigger, DeletedTrigger string // on the table
	PromptClaim                    string // promptClaim as an SQL interval
	PointsHead                     string // pointsHead
	settled                        string // SettledTrigger unquoted
	// String literals, set by Migrate.
	Channel            string
	ClaimSignature     string // Claim with its argument types, for to_regprocedure
	TableName          string // Table, for a cast to regclass
	SettledTriggerName string // settled, for a comparison with pg_trigger.tgname
}

// interval is d as an SQL interval literal.
func interval(d time.Duration) string {
	return fmt.Sprintf("interval '%d microseconds'", d.Microseconds())
}

func newNames(table string) names {
	parts := strings.Split(table, ".")
	schema, base := parts[:len(parts)-1], parts[len(parts)-1]
	qualified := func(suffix string) string {
		return pgx.Identifier(append(schema[:len(schema):len(schema)], base+suffix)).Sanitize()
	}
	bare := func(suffix string) string { return pgx.Identifier{base + suffix}.Sanitize() }
	return names{
		Table:          qualified(""),
		Claim:          qualified("_claim"),
		Create:         qualified("_create"),
		Wake:           qualified("_wake"),
		Complete:       qualified("_complete"),
		Release:        qualified("_release"),
		Forget:         qualified("_forget"),
		Heartbeat:      qualified("_heartbeat"),
		Point:          qualified("_point"),
		ExpiresIndex:   bare("_expires_at_idx"),
		LeaseIndex:     bare("_lease_until_idx"),
		SettledTrigger: bare("_settled"),
		settled:        base + "_settled",
		DeletedTrigger: bare("_deleted"),
		PromptClaim:    interval(promptClaim),
		PointsHead:     pointsHead,
	}
}

// Migrate creates the table, its indexes, and the functions and triggers the
// Store runs, or brings the functions and triggers up to date. It is safe to
// run from many instances at once: each runs it in a transaction under an
// advisory lock named after the table. It never waits long for a lock on
// the table, which would hold up every store call behind it: while a
// transaction holds the table (a CompleteTx not yet committed, a VACUUM) it
// tries again, each attempt waiting a little longer (100ms, then up to 2s),
// until ctx is done. A role without the privileges to create or change
// them (a runtime role apart from the owner) fails at once, with an error
// that does not wrap ErrUnavailable: no retry helps.
func (s *Store) Migrate(ctx context.Context) error {
	return s.migrate(ctx, schemaTemplate)
}

// migrateLockTimeout bounds how long one attempt of a migration waits for a
// lock on the table. CREATE INDEX takes a SHARE lock and CREATE OR REPLACE
// TRIGGER a SHARE ROW EXCLUSIVE one even when nothing changes, and
// PostgreSQL queues every later lock request behind a waiting one: a
// migration waiting for a transaction that holds the table (a CompleteTx
// not yet committed, a VACUUM) would hold up every claim, renewal and
// completion on the table with it, on every instance. An attempt that
// times out gives its place in the queue up and is tried again.
//
// Each attempt after a timeout waits twice as long, up to
// maxMigrateLockTimeout: under steady traffic whose transactions on the
// table (CompleteTx in a business transaction) outlast the first timeout,
// one of them is always open when an attempt asks, and the same timeout
// would starve the migration for as long as the traffic lasts. The longest
// wait is above PostgreSQL's default deadlock_timeout (1s), after which a
// waiting lock request cancels an autovacuum of the table that blocks it;
// a shorter one would wait out the whole vacuum.
const (
	migrateLockTimeout    = 100 * time.Millisecond
	maxMigrateLockTimeout = 2 * time.Second
)

// migrate runs the schema that tmpl renders, as Migrate describes, trying
// again after a lock timeout until ctx is done.
func (s *Store) migrate(ctx context.Context, tmpl *template.Template) error {
	// Each attempt waits as long for its locks as the pause before it.
	wait := migrateLockTimeout
	for {
		err := s.migrateOnce(ctx, tmpl, wait)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42501" {
			// insufficient_privilege: no retry helps, so no ErrUnavailable.
			return fmt.Errorf("postgres migrate: this role may not create or change the table and its functions; "+
				"run Migrate as the role that owns them (docs/security.md, least privilege): %w", pgErr)
		}
		// lock_not_available, or a deadlock the server broke by failing
		// this attempt: it rolled back, and the next one may get through.
		if !errors.As(err, &pgErr) || (pgErr.Code != "55P03" && pgErr.Code != "40P01") {
			return err
		}
		select {
		case <-ctx.Done():
			return storeerr.Unavailable("postgres migrate", errors.Join(err, context.Cause(ctx)))
		case <-time.After(wait):
		}
		wait = min(2*wait, maxMigrateLockTimeout)
	}
}

// migrateOnce makes one attempt of migrate, waiting at most lockTimeout
// for each lock on the table.
func (s *Store) migrateOnce(ctx context.Context, tmpl *template.Template, lockTimeout time.Duration) error {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return storeerr.Unavailable("postgres migrate", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// Concurrent CREATE ... IF NOT EXISTS can still fail on a catalog unique
	// index, and concurrent CREATE OR REPLACE FUNCTION with "tuple
	// concurrently updated": the lock makes the migrations take turns.
	lock := sha256.Sum256([]byte("idempotency-go postgres migrate " + s.opts.Table))
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, int64(binary.BigEndian.Uint64(lock[:8]))); err != nil {
		return storeerr.Unavailable("postgres migrate", err)
	}
	// Set after the advisory lock: concurrent migrations wait their turn.
	if _, err := tx.Exec(ctx, fmt.Sprintf("SET LOCAL lock_timeout = %d", lockTimeout.Milliseconds())); err != nil {
		return storeerr.Unavailable("postgres migrate", err)
	}
	n := newNames(s.opts.Table)
	escape := tx.Conn().PgConn().EscapeString
	channel, err1 := escape(s.opts.Channel)
	signature, err2 := escape(n.Claim + "(text, text, bytea, text, bigint, bigint, boolean)")
	table, err3 := escape(n.Table)
	settled, err4 := escape(n.settled)
	if err := errors.Join(err1, err2, err3, err4); err != nil {
		return storeerr.Unavailable("postgres migrate", err)
	}
	n.Channel, n.ClaimSignature, n.TableName = "'"+channel+"'", "'"+signature+"'", "'"+table+"'"
	n.SettledTriggerName = "'" + settled + "'"
	var schema strings.Builder
	if err := tmpl.Execute(&schema, n); err != nil {
		return fmt.Errorf("postgres: rendering schema.sql: %w", err)
	}
	// Without arguments, pgx sends the script in one simple-protocol query,
	// which may hold many statements.
	if _, err := tx.Exec(ctx, schema.String()); err != nil {
		return storeerr.Unavailable("postgres migrate", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return storeerr.Unavailable("postgres migrate", err)
	}
	return nil
}

// Complete implements idempotency.Store.
func (s *Store) Complete(ctx context.Context, k idempotency.Key, token uint64, resp idempotency.Response, retention time.Duration) error {
	return s.completeRecord(ctx, s.pooled, k, token, resp, retention)
}

// CompleteTx stores resp as the outcome of the operation in ctx (the
// context Guard.Do gives its function, or a guarded handler's request
// context) inside the caller's transaction tx: the record is completed if
// and only if tx commits, so that a business write made in tx and the
// completion are both visible or neither. The record's key, the attempt's
// fencing token and the retention come from ctx.
//
// After CompleteTx, commit tx, then return without an error and write
// nothing: Do returns resp and the middleware answers with it, exactly what
// was committed, and nothing more is stored. An operation that fails after
// CompleteTx (an error, or a handler's 5xx) has its record released, which
// the store refuses if tx did commit: the caller gets ErrFenced (a 503) and
// its retry replays what was committed.
//
// It fails with ErrNoOperation when ctx carries no operation,
// ErrForeignStore when the operation's Guard keeps its records in another
// store (a migrating store included), and ErrFenced once the owner's lease
// has run out, by this process's clock or the database's, even if no one
// took the record over yet; on any error, roll tx back.
//
// From the completion on, the record's row stays locked until tx ends, so no
// claim can take the record over before tx commits or rolls back, and
// waiters are woken when it commits. Commit tx with the operation's context:
// pgx sends no COMMIT on a context that is done, so a transaction still open
// when the owner's lease ends locally rolls back instead of committing. The
// owner's renewals wait on the row lock meanwhile, so commit promptly: a
// transaction held open after CompleteTx for about two thirds of the lease
// can outlast it.
func (s *Store) CompleteTx(ctx context.Context, tx pgx.Tx, resp idempotency.Response) error {
	return idempotency.CompleteOutside(ctx, s, resp, func(k idempotency.Key, token uint64, retention time.Duration) error {
		return s.completeRecord(ctx, inTx(tx), k, token, resp, retention)
	})
}

// Release implements idempotency.Store.
func (s *Store) Release(ctx context.Context, k idempotency.Key, token uint64) error {
	return s.settle(ctx, s.pooled, "release", s.release, k, token)
}

// Forget implements idempotency.Store.
func (s *Store) Forget(ctx context.Context, k idempotency.Key, token uint64) error {
	return s.settle(ctx, s.pooled, "forget", s.forget, k, token)
}

// Heartbeat implements idempotency.Store.
func (s *Store) Heartbeat(ctx context.Context, k idempotency.Key, token uint64, lease time.Duration) error {
	return s.ownerWrite(ctx, s.pooled, "heartbeat", s.heartbeat, k, token, lease.Microseconds())
}

// Abandon implements idempotency.Store: the lease's end becomes the
// database's now(), which no later claim's now() precedes, so the next claim
// takes the record over as abandoned.
func (s *Store) Abandon(ctx context.Context, k idempotency.Key, token uint64) error {
	return s.ownerWrite(ctx, s.pooled, "abandon", s.heartbeat, k, token, int64(0))
}

// SaveRecoveryPoint implements idempotency.RecoveryPointStore, in one round
// trip: the point function (schema.sql) appends p's entry to the record's.
func (s *Store) SaveRecoveryPoint(ctx context.Context, k idempotency.Key, token uint64, p idempotency.RecoveryPoint) error {
	return s.savePoint(ctx, s.pooled, k, token, p)
}

// RecoveryPoints implements idempotency.RecoveryPointStore, in one round
// trip.
func (s *Store) RecoveryPoints(ctx context.Context, k idempotency.Key, token uint64) ([]idempotency.RecoveryPoint, error) {
	var b []byte
	err := s.withPooled(ctx, func(c ownerConn) error { return s.points.queryRow(ctx, c, k, token, nil, &b) })
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil, storeerr.Fenced("postgres recovery points")
	case err != nil:
		return nil, storeerr.Unavailable("postgres recovery points", err)
	}
	ps, err := wire.ParsePoints(b)
	if err != nil {
		return nil, storeerr.Unavailable("postgres recovery points", fmt.Errorf("record %q: %w", k, err))
	}
	var out []idempotency.RecoveryPoint
	for _, p := range ps {
		out = append(out, idempotency.RecoveryPoint(p))
	}
	return out, nil
}

// stepsOf names the steps of the recovery points' entries b.
func stepsOf(b []byte) ([]string, error) {
	ps, err := wire.ParsePoints(b)
	var steps []string
	for _, p := range ps {
		steps = append(steps, p.Step)
	}
	return steps, err
}

// pointsSQL is the owner's read of its record's recovery points on the
// table of n: only while the token owns the record, as for the owner's
// writes (statements.sql); the lease is not judged.
func pointsSQL(n names) string {
	return `SELECT ` + rowPoints + ` FROM ` + n.Table + ` t WHERE ` + render(n, "owned", ownerParams(func(*params) {}))
}

// pointsHead is how the recovery points of row t begin: the length of its
// operation ID in one byte (an ID is 1 to 255 bytes), then the ID. Points
// that begin otherwise belong to an earlier record of the key, and count as
// none.
const pointsHead = `(set_byte('\x00'::bytea, 0, octet_length(convert_to(t.operation_id, 'UTF8'))) || convert_to(t.operation_id, 'UTF8'))`

// rowPoints is the entries of row t's recovery points after pointsHead, or
// NULL when it has none of its own.
const rowPoints = `CASE WHEN substring(t.points FROM 1 FOR octet_length(` + pointsHead + `)) = ` + pointsHead + `
	THEN substring(t.points FROM octet_length(` + pointsHead + `) + 1) END`

// StepTx records result as the result of the step whose function runs in
// ctx (the context idempotency.Step gives its function) inside the
// caller's transaction tx: the step is recorded if and only if tx commits,
// so that a business write made in tx and the recovery point are both
// visible or neither, and a later attempt either finds both or runs the
// step again. The record's key and the attempt's fencing token come from
// ctx, and result is encoded with the step's codec.
//
// Pass as result the value the step's function returns: a later attempt
// gets the one committed back from Step instead of running the function.
// Commit tx before the function returns; if tx does not commit, return an
// error from the function, so that this attempt does not take the step for
// recorded either.
//
// It fails with ErrInvalidStep outside a step's function (or when the
// encoded result is over idempotency.MaxStepResult), ErrForeignStore when
// the operation's Guard keeps its records in another store (a migrating
// store included), and ErrFenced once the owner's lease has run out, by this
// process's clock or the database's, even if no one took the record over
// yet; on any error, roll tx back.
//
// From the recording on, the record's row stays locked until tx ends, so no
// claim can take the record over before tx commits or rolls back. Commit tx
// with the operation's context: pgx sends no COMMIT on a context that is
// done, so a transaction still open when the owner's lease ends locally
// rolls back instead of committing. The owner's renewals wait on the row
// lock meanwhile, so commit promptly: a transaction held open after StepTx
// for about two thirds of the lease can outlast it.
func (s *Store) StepTx(ctx context.Context, tx pgx.Tx, result any) error {
	return idempotency.SaveStepOutside(ctx, s, result, func(k idempotency.Key, token uint64, p idempotency.RecoveryPoint) error {
		return s.savePoint(ctx, inTx(tx), k, token, p)
	})
}

// ListAbandoned implements idempotency.Store, in one statement on the partial
// index of the records in flight, the longest abandoned first.
func (s *Store) ListAbandoned(ctx context.Context, limit int) ([]idempotency.AbandonedRecord, error) {
	if limit <= 0 {
		return nil, nil // none wanted; LIMIT would refuse a negative count
	}
	rows, err := s.pool.Query(ctx, s.abandonedSQL, limit)
	if err != nil {
		return nil, storeerr.Unavailable("postgres abandoned", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (idempotency.AbandonedRecord, error) {
		var (
			a  idempotency.AbandonedRecord
			fp []byte
		)
		if err := row.Scan(&a.Key.Scope, &a.Key.Name, &fp); err != nil {
			return a, err
		}
		if len(fp) != len(a.Fingerprint) {
			return a, fmt.Errorf("record %q has a fingerprint of %d bytes", a.Key, len(fp))
		}
		a.Fingerprint = idempotency.Fingerprint(fp)
		return a, nil
	})
	if err != nil {
		return nil, storeerr.Unavailable("postgres abandoned", err)
	}
	return out, nil
}

// Stats counts the records in flight, in one statement on the partial index
// of the records in flight, by the database's clock.
func (s *Store) Stats(ctx context.Context) (idempotency.Stats, error) {
	var st idempotency.Stats
	if err := s.pool.QueryRow(ctx, s.statsSQL).Scan(&st.InFlight, &st.Abandoned); err != nil {
		return idempotency.Stats{}, storeerr.Unavailable("postgres stats", err)
	}
	return st, nil
}

// DeleteExpired deletes the records whose retention has run out and returns
// how many it deleted. Claims already treat them as absent; deleting them
// only frees the space, so run it on a schedule (every few minutes, say)
// from one instance or many.
func (s *Store) DeleteExpired(ctx context.Context) (int64, error) {
	var total int64
	for {
		tag, err := s.pool.Exec(ctx, s.deleteSQL, deleteBatch)
		if err != nil {
			return total, storeerr.Unavailable("postgres delete expired", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < deleteBatch {
			return total, nil
		}
	}
}

func (s *Store) completeRecord(ctx context.Context, on onConn, k idempotency.Key, token uint64, resp idempotency.Response, retention time.Duration) error {
	b := wire.AppendResponse(nil, resp.Status, resp.Header, resp.Body)
	return s.settle(ctx, on, "complete", s.complete, k, token, b, retention.Microseconds(), on.inTx)
}

func (s *Store) savePoint(ctx context.Context, on onConn, k idempotency.Key, token uint64, p idempotency.RecoveryPoint) error {
	return s.ownerWrite(ctx, on, "save recovery point", s.point, k, token, wire.AppendPoint(nil, p.Step, p.Result), on.inTx)
}

// onConn runs an owner's statement on a connection: one of the pool's, or
// a transaction's.
type onConn struct {
	with func(ctx context.Context, f func(ownerConn) error) error
	inTx bool // the caller's transaction: the lease is judged by the clock at the statement
}

// withPooled runs f on a connection of the pool, held for f.
func (s *Store) withPooled(ctx context.Context, f func(ownerConn) error) error {
	return s.pool.AcquireFunc(ctx, func(c *pgxpool.Conn) error { return f(ownerConn{c.Conn(), s.prepares}) })
}

// inTx is onConn on tx's connection, which may come from another pool.
func inTx(tx pgx.Tx) onConn {
	return onConn{inTx: true, with: func(_ context.Context, f func(ownerConn) error) error {
		return f(ownerConn{tx.Conn(), prepares(tx.Conn().Config())})
	}}
}

// ownerWrite runs an owner's write, which changes the record only if token
// owns it: ErrFenced when it changed nothing, ErrUnavailable when it failed.
func (s *Store) ownerWrite(ctx context.Context, on onConn, op string, st *ownerStatement, k idempotency.Key, token uint64, args ...any) error {
	var changed int64
	err := on.with(ctx, func(c ownerConn) (err error) {
		changed, err = st.exec(ctx, c, k, token, args)
		return err
	})
	if err != nil {
		return storeerr.Unavailable("postgres "+op, err)
	}
	if changed == 0 {
		return storeerr.Fenced("postgres " + op)
	}
	return nil
}

// settle runs an owner's write that settles the record, and wakes the
// record's waiters if any registered: on the same connection, and so in the
// caller's transaction if there is one. Once the record is settled outside
// a transaction, a notification that fails is not its caller's error: the
// waiters re-read the record on their own within Options.RecheckInterval.
func (s *Store) settle(ctx context.Context, on onConn, op string, st *ownerStatement, k idempotency.Key, token uint64, args ...any) error {
	var settled, waiters bool
	err := on.with(ctx, func(c ownerConn) error {
		err := st.queryRow(ctx, c, k, token, args, &waiters)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		settled = err == nil
		if err != nil || !waiters {
			return err
		}
		_, err = c.Exec(ctx, `SELECT pg_notify($1, $2)`, pgx.QueryExecModeExec, s.opts.Channel, wakeID(k))
		if on.inTx {
			return err
		}
		return nil
	})
	if err != nil {
		return storeerr.Unavailable("postgres "+op, err)
	}
	if !settled {
		return storeerr.Fenced("postgres " + op)
	}
	return nil
}

// Inspect implements idempotency.Inspector.
func (s *Store) Inspect(ctx context.Context, k idempotency.Key) (idempotency.Record, error) {
	rows, err := s.pool.Query(ctx, s.inspectSQL, k.Scope, k.Name)
	if err != nil {
		return idempotency.Record{}, storeerr.Unavailable("postgres inspect", err)
	}
	recs, _, err := collectInspected(rows)
	switch {
	case err != nil:
		return idempotency.Record{}, storeerr.Unavailable("postgres inspect", err)
	case len(recs) == 0:
		return idempotency.Record{}, fmt.Errorf("%w of %v", idempotency.ErrNoRecord, k)
	}
	return recs[0], nil
}

// ListInFlight implements idempotency.Inspector, on the partial index of
// the records in flight. Its cursor is the last record's lease end, in
// microseconds, and key.
func (s *Store) ListInFlight(ctx context.Context, after string, limit int) ([]idempotency.Record, string, error) {
	if limit <= 0 {
		return nil, after, nil
	}
	from, key := pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}, idempotency.Key{}
	if after != "" {
		endUS, k, err := idempotency.ParsePageCursor(after)
		if err != nil {
			return nil, "", err
		}
		from, key = pgtype.Timestamptz{Time: time.UnixMicro(endUS), Valid: true}, k
	}
	rows, err := s.pool.Query(ctx, s.inflightSQL, from, key.Scope, key.Name, limit)
	if err != nil {
		return nil, "", storeerr.Unavailable("postgres inflight", err)
	}
	recs, ends, err := collectInspected(rows)
	if err != nil {
		return nil, "", storeerr.Unavailable("postgres inflight", err)
	}
	if len(recs) < limit {
		return recs, "", nil
	}
	last := len(recs) - 1
	return recs, idempotency.PageCursor(ends[last], recs[last].Key), nil
}

// collectInspected reads the rows of inspected, and each one's lease end in
// microseconds.
func collectInspected(rows pgx.Rows) ([]idempotency.Record, []int64, error) {
	defer rows.Close()
	var (
		recs []idempotency.Record
		ends []int64
	)
	for rows.Next() {
		var (
			r                        idempotency.Record
			state                    string
			fp, response, points     []byte
			token                    int64
			leftUS, expiresUS, ageUS int64
			endUS                    int64
		)
		err := rows.Scan(&r.Key.Scope, &r.Key.Name, &state, &r.OperationID, &fp, &r.Attempt, &token, &response,
			&leftUS, &expiresUS, &ageUS, &endUS, &points)
		if err != nil {
			return nil, nil, err
		}
		if len(fp) != len(r.Fingerprint) {
			return nil, nil, fmt.Errorf("record %q has a fingerprint of %d bytes", r.Key, len(fp))
		}
		r.Fingerprint, r.Token = idempotency.Fingerprint(fp), uint64(token)
		if r.Steps, err = stepsOf(points); err != nil {
			return nil, nil, fmt.Errorf("record %q: %w", r.Key, err)
		}
		r.ExpiresIn, r.Age = time.Duration(expiresUS)*time.Microsecond, time.Duration(ageUS)*time.Microsecond
		switch {
		case state == "completed":
			var resp idempotency.Response
			if resp.Status, resp.Header, resp.Body, err = wire.ParseResponse(response); err != nil {
				return nil, nil, fmt.Errorf("record %q: %w", r.Key, err)
			}
			r.State = idempotency.RecordCompleted
			r.SetResponse(resp)
		case state == "released":
			r.State = idempotency.RecordReleased
		case state != "in_progress":
			return nil, nil, fmt.Errorf("record %q: unknown state %q", r.Key, state)
		case leftUS > 0:
			r.State, r.LeaseLeft = idempotency.RecordInFlight, time.Duration(leftUS)*time.Microsecond
		default:
			r.State, r.LeaseLeft = idempotency.RecordAbandoned, time.Duration(leftUS)*time.Microsecond
		}
		recs, ends = append(recs, r), append(ends, endUS)
	}
	return recs, ends, rows.Err()
}

// Subscribe implements idempotency.Store. The Store listens on one
// connection of its own, taken from the pool at the first Subscribe and kept
// until Close. Subscribe returns once that connection is listening, so every
// notification sent afterwards reaches it; if the connection is lost, the
// Store reconnects and then wakes every subscriber, since what was sent in
// between is lost.
func (s *Store) Subscribe(ctx context.Context, k idempotency.Key) (idempotency.Subscription, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, storeerr.Unavailable("postgres subscribe", errClosed)
	}
	if s.stop == nil {
		lctx, stop := context.WithCancel(context.Background())
		s.stop, s.stopped = stop, make(chan struct{})
		go s.listen(lctx)
	}
	sub := s.subs.Add(wakeID(k))
	listening, stopped := s.listening, s.stopped
	s.mu.Unlock()

	select {
	case <-listening:
		return sub, nil
	case <-stopped:
		sub.Close()
		return nil, storeerr.Unavailable("postgres subscribe", errClosed)
	case <-ctx.Done():
		sub.Close()
		s.mu.Lock()
		err := errors.Join(context.Cause(ctx), s.listenErr)
		s.mu.Unlock()
		return nil, storeerr.Unavailable("postgres subscribe", err)
	}
}

var errClosed = errors.New("store closed")

// Close stops the listener and wakes every subscriber, which then re-read
// their records. Close it before the pool.
func (s *Store) Close() {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	s.subs.WakeAll()
	stop, stopped := s.stop, s.stopped
	s.mu.Unlock()
	if stop != nil {
		stop()
		<-stopped
	}
}

// listen keeps a connection listening until ctx is done, reconnecting with
// backoff whenever it is lost.
func (s *Store) listen(ctx context.Context) {
	defer close(s.stopped)
	delay := minReconnectDelay
	listened := false
	for {
		if s.listenOnce(ctx, listened) {
			listened, delay = true, minReconnectDelay
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, maxReconnectDelay)
	}
}

// listenOnce takes a connection, listens on it and dispatches its
// notifications until it fails. It reports whether it got to listen.
// reconnect says that an earlier connection listened, and so that
// notifications may have been lost since.
func (s *Store) listenOnce(ctx context.Context, reconnect bool) (listened bool) {
	conn, err := s.dialListener(ctx)
	if conn != nil {
		defer func() {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			defer cancel()
			_ = conn.Close(cctx)
		}()
	}
	if err != nil {
		s.lost(err)
		return false
	}

	s.mu.Lock()
	s.up, s.listenErr = true, nil
	close(s.listening)
	if reconnect {
		// Notifications sent while no connection listened are lost: every
		// subscriber re-reads its record.
		s.subs.WakeAll()
	}
	s.mu.Unlock()

	for {
		n, silent, err := waitNotification(ctx, conn)
		if n != nil {
			s.subs.Wake(n.Payload)
		}
		if silent {
			// Silent for listenPing: a read that timed out leaves the
			// connection usable; ask the server whether it is still there.
			// Notifications that arrive meanwhile are kept for the next wait.
			pctx, cancel := context.WithTimeout(ctx, listenPing)
			err = conn.Ping(pctx)
			cancel()
		}
		if err != nil {
			s.lost(err)
			return true
		}
	}
}

// dialListener takes a connection of its own from the pool and has it
// LISTEN, within listenPing. It returns the connection whenever it got one,
// for the caller to close, even with an error.
func (s *Store) dialListener(ctx context.Context) (*pgx.Conn, error) {
	actx, cancel := context.WithTimeout(ctx, listenPing)
	defer cancel()
	pc, err := s.pool.Acquire(actx)
	if err != nil {
		return nil, err
	}
	// Hijacked: a connection in LISTEN must not go back to the pool.
	conn := pc.Hijack()
	_, err = conn.Exec(actx, "LISTEN "+pgx.Identifier{s.opts.Channel}.Sanitize())
	return conn, err
}

// waitNotification waits for a notification on conn for at most
// listenPing, and reports silent when none came in that time. The wait is
// bounded by a read deadline on the connection, not by a context: a context
// that ends goes through the connection's ContextWatcherHandler, which an
// application may have made a CancelRequestContextWatcherHandler, and that
// would send the server a cancel request, on a connection of its own, at
// every listenPing of silence (which an idle backend ignores), and hold the
// wait until its DeadlineDelay.
func waitNotification(ctx context.Context, conn *pgx.Conn) (n *pgconn.Notification, silent bool, err error) {
	nc := conn.PgConn().Conn()
	if err := nc.SetReadDeadline(time.Now().Add(listenPing)); err != nil {
		return nil, false, err
	}
	n, err = conn.WaitForNotification(ctx)
	if err != nil && ctx.Err() == nil && pgconn.Timeout(err) && !conn.IsClosed() {
		// The read deadline, not ctx: clear it for the ping.
		if derr := nc.SetReadDeadline(time.Time{}); derr != nil {
			return n, false, derr
		}
		return n, true, nil
	}
	_ = nc.SetReadDeadline(time.Time{})
	return n, false, err
}

// lost records that the listener has no listening connection.
func (s *Store) lost(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.listenErr = err
	if s.up {
		s.up, s.listening = false, make(chan struct{})
	}
}

// wakeID names a record in notifications as the trigger in schema.sql does.
func wakeID(k idempotency.Key) string {
	sum := sha256.Sum256([]byte(k.Scope + "\x00" + k.Name))
	return hex.EncodeToString(sum[:16])
}
