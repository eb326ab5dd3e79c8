package postgres_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net/http"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
	"github.com/idempotency-go/idempotency/seal"
)

// sealMarker is in every body, header value, step result and request of
// these tests: a sealed store must keep it nowhere in the table.
const sealMarker = "MARKER-4111111111111111-cvv-737"

var (
	sealRequest = idempotency.FingerprintOf("POST /v1/charges", []byte(`{"card":"`+sealMarker+`"}`))
	errSealStep = errors.New("the operation failed after its step")
)

func sealKey(id uint32) seal.Key {
	k := seal.Key{ID: id}
	_, _ = rand.Read(k.Secret[:])
	return k
}

// sealRig is one PostgreSQL server with a pool, for the sealed tests.
type sealRig struct {
	pool   *pgxpool.Pool
	tables int
}

// store returns a migrated Store on a table of its own, and the table.
func (r *sealRig) store(t *testing.T) (*postgres.Store, string) {
	t.Helper()
	r.tables++
	table := fmt.Sprintf("sealed_%d", r.tables)
	s := postgres.New(r.pool, postgres.Options{Table: table, Channel: table + "_wake"})
	require.NoError(t, s.Migrate(t.Context()))
	t.Cleanup(s.Close)
	return s, table
}

func sealWrap(t *testing.T, inner idempotency.Store, keys seal.Keys) *seal.Store {
	t.Helper()
	s, err := seal.New(inner, keys)
	require.NoError(t, err)
	return s
}

// TestSealPostgres runs the sealed store over PostgreSQL: the conformance
// suite, what the table keeps, a moved response, rotation, and CompleteTx
// and StepTx on a sealed Guard.
func TestSealPostgres(t *testing.T) {
	pg := testserver.StartPostgres(t)
	cfg, err := pgxpool.ParseConfig(pg.DSN)
	require.NoError(t, err)
	cfg.MaxConns = 60 // the suite's 50 racing claimers hold a connection each
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	r := &sealRig{pool: pool}

	t.Run("Conformance", func(t *testing.T) {
		inner, _ := r.store(t)
		s := sealWrap(t, inner, seal.Keys{Current: sealKey(2), Earlier: []seal.Key{sealKey(1)}})
		idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness { return idempotencytest.Harness{Store: s} })
	})
	t.Run("RawRows", func(t *testing.T) { testSealRawRows(t, r) })
	t.Run("CopiedResponse", func(t *testing.T) { testSealCopiedResponse(t, r) })
	t.Run("Rotation", func(t *testing.T) { testSealRotation(t, r) })
	t.Run("CompleteTxRefused", func(t *testing.T) { testSealCompleteTxRefused(t, r) })
	t.Run("OneCommit", func(t *testing.T) { testSealOneCommit(t, r) })
}

func sealResponse(id string) idempotency.Response {
	return idempotency.Response{Status: http.StatusCreated,
		Header: http.Header{"X-Card": {sealMarker}, "Set-Cookie": {"a=1", "session=" + sealMarker}},
		Body:   []byte(`{"id":"` + id + `","card":"` + sealMarker + `"}`)}
}

func sealComplete(t *testing.T, g *idempotency.Guard, k idempotency.Key, resp idempotency.Response) {
	t.Helper()
	_, err := g.Do(t.Context(), k, sealRequest, func(context.Context) (idempotency.Response, error) { return resp, nil })
	require.NoError(t, err)
}

// sealStepThenFail records a step whose result carries the marker, then
// fails: the record is released and keeps the step.
func sealStepThenFail(ctx context.Context) (idempotency.Response, error) {
	if _, err := idempotency.Step(ctx, "charge", func(context.Context) (string, error) { return "ch_" + sealMarker, nil }); err != nil {
		return idempotency.Response{}, err
	}
	return idempotency.Response{}, errSealStep
}

func sealMustNotRun(t *testing.T) func(context.Context) (idempotency.Response, error) {
	return func(context.Context) (idempotency.Response, error) {
		t.Error("the operation ran")
		return idempotency.Response{}, nil
	}
}

// sealLeaks returns the rows of table, every column as PostgreSQL sends
// it, that hold the marker or the request's bare fingerprint, and how many
// rows there are.
func sealLeaks(t *testing.T, pool *pgxpool.Pool, table string) (leaks []string, rows int) {
	t.Helper()
	rs, err := pool.Query(t.Context(), "SELECT * FROM "+table)
	require.NoError(t, err)
	defer rs.Close()
	for rs.Next() {
		rows++
		for i, col := range rs.RawValues() {
			if bytes.Contains(col, []byte(sealMarker)) || bytes.Contains(col, sealRequest[:]) {
				leaks = append(leaks, fmt.Sprintf("row %d, column %s", rows, rs.FieldDescriptions()[i].Name))
			}
		}
	}
	require.NoError(t, rs.Err())
	return leaks, rows
}

// The table of a sealed store holds no body, header value, step result or
// bare fingerprint; the same operations on the bare store, as a control,
// leave the marker in clear.
func testSealRawRows(t *testing.T, r *sealRig) {
	released, done := idempotency.Key{Scope: "acct_1", Name: "released"}, idempotency.Key{Scope: "acct_1", Name: "done"}
	write := func(s idempotency.Store) {
		g := idempotency.New(s, idempotency.Options{})
		_, err := g.Do(t.Context(), released, sealRequest, sealStepThenFail)
		require.ErrorIs(t, err, errSealStep)
		sealComplete(t, g, done, sealResponse("ch_2"))
	}
	bare, bareTable := r.store(t)
	write(bare)
	leaks, _ := sealLeaks(t, r.pool, bareTable)
	require.NotEmpty(t, leaks, "the control: the bare store keeps the marker in clear")

	inner, table := r.store(t)
	s := sealWrap(t, inner, seal.Keys{Current: sealKey(1)})
	write(s)
	leaks, rows := sealLeaks(t, r.pool, table)
	assert.Empty(t, leaks)
	assert.Equal(t, 2, rows)
	var points int
	require.NoError(t, r.pool.QueryRow(t.Context(), "SELECT count(*) FROM "+table+" WHERE points IS NOT NULL").Scan(&points))
	assert.Equal(t, 1, points, "the released record's recovery point")

	res, err := idempotency.New(s, idempotency.Options{}).Do(t.Context(), done, sealRequest, sealMustNotRun(t))
	require.NoError(t, err)
	assert.Equal(t, sealResponse("ch_2"), res.Response)
}

// A sealed response copied by UPDATE to another tenant's record of the
// same request, or to another key's, does not open: the claim fails.
func testSealCopiedResponse(t *testing.T, r *sealRig) {
	inner, table := r.store(t)
	g := idempotency.New(sealWrap(t, inner, seal.Keys{Current: sealKey(1)}), idempotency.Options{})
	from := idempotency.Key{Scope: "acct_1", Name: "charge-1"}
	sealComplete(t, g, from, sealResponse("ch_1"))
	for _, to := range []idempotency.Key{{Scope: "acct_2", Name: "charge-1"}, {Scope: "acct_1", Name: "charge-2"}} {
		sealComplete(t, g, to, idempotency.Response{Status: http.StatusCreated, Body: []byte(`{"id":"theirs"}`)})
		tag, err := r.pool.Exec(t.Context(), "UPDATE "+table+" SET response = (SELECT response FROM "+table+
			" WHERE scope = $1 AND key = $2) WHERE scope = $3 AND key = $4", from.Scope, from.Name, to.Scope, to.Name)
		require.NoError(t, err)
		require.EqualValues(t, 1, tag.RowsAffected())
		res, err := g.Do(t.Context(), to, sealRequest, sealMustNotRun(t))
		require.ErrorIs(t, err, seal.ErrUnopenable, "%v holding the response of %v", to, from)
		assert.Zero(t, res)
	}
}

// Key 1's record and key 2's replay while both are configured; once key 1
// is removed, key 1's fails with ErrUnknownKey and runs nothing.
func testSealRotation(t *testing.T, r *sealRig) {
	inner, _ := r.store(t)
	key1, key2 := sealKey(1), sealKey(2)
	old, fresh := idempotency.Key{Scope: "acct_1", Name: "old"}, idempotency.Key{Scope: "acct_1", Name: "new"}
	sealComplete(t, idempotency.New(sealWrap(t, inner, seal.Keys{Current: key1}), idempotency.Options{}), old, sealResponse("ch_old"))
	g2 := idempotency.New(sealWrap(t, inner, seal.Keys{Current: key2, Earlier: []seal.Key{key1}}), idempotency.Options{})
	sealComplete(t, g2, fresh, sealResponse("ch_new"))
	for k, id := range map[idempotency.Key]string{old: "ch_old", fresh: "ch_new"} {
		res, err := g2.Do(t.Context(), k, sealRequest, sealMustNotRun(t))
		require.NoError(t, err, "%v", k)
		assert.Equal(t, sealResponse(id), res.Response)
	}
	g3 := idempotency.New(sealWrap(t, inner, seal.Keys{Current: key2}), idempotency.Options{})
	_, err := g3.Do(t.Context(), old, sealRequest, sealMustNotRun(t))
	require.ErrorIs(t, err, seal.ErrUnknownKey)
	assert.Contains(t, err.Error(), "key ID 1")
	res, err := g3.Do(t.Context(), fresh, sealRequest, sealMustNotRun(t))
	require.NoError(t, err)
	assert.Equal(t, sealResponse("ch_new"), res.Response)
}

// CompleteTx and StepTx on a Guard made with a sealed store fail with
// ErrForeignStore before writing anything: they would write clear text.
// The table holds no marker afterwards, and the record was released.
func testSealCompleteTxRefused(t *testing.T, r *sealRig) {
	inner, table := r.store(t)
	g := idempotency.New(sealWrap(t, inner, seal.Keys{Current: sealKey(1)}), idempotency.Options{})
	k := idempotency.Key{Scope: "acct_1", Name: "in-tx"}
	var completeErr, stepErr error
	_, err := g.Do(t.Context(), k, sealRequest, func(ctx context.Context) (idempotency.Response, error) {
		_, stepErr = idempotency.Step(ctx, "charge", func(ctx context.Context) (string, error) {
			tx, err := r.pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(context.Background())
			return "", inner.StepTx(ctx, tx, "ch_"+sealMarker)
		})
		tx, err := r.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(context.Background())
		completeErr = inner.CompleteTx(ctx, tx, sealResponse("ch_tx"))
		return idempotency.Response{}, completeErr
	})
	require.ErrorIs(t, stepErr, idempotency.ErrForeignStore, "StepTx")
	require.ErrorIs(t, completeErr, idempotency.ErrForeignStore, "CompleteTx")
	require.ErrorIs(t, err, idempotency.ErrForeignStore)
	leaks, rows := sealLeaks(t, r.pool, table)
	assert.Empty(t, leaks)
	assert.Equal(t, 1, rows)
	rec, err := inner.Inspect(t.Context(), k)
	require.NoError(t, err)
	assert.Equal(t, idempotency.RecordReleased, rec.State)
	assert.Empty(t, rec.Steps)
}

// The one-commit mode sealed by seal.NewTx keeps its mode, the business
// write and the sealed record committing together, and its records hold
// no marker; a replay opens the response, across a rotation too, and runs
// nothing; another request is a mismatch. seal.New refuses the mode, which
// it would run as the lease mode, with no transaction for the operation.
func testSealOneCommit(t *testing.T, r *sealRig) {
	inner, table := r.store(t)
	oc := inner.OneCommit()
	_, err := seal.New(oc, seal.Keys{Current: sealKey(1)})
	require.ErrorContains(t, err, "NewTx")
	_, err = seal.NewTx(inner, seal.Keys{Current: sealKey(1)})
	require.ErrorContains(t, err, "Transactor")
	ledger := table + "_ledger"
	_, err = r.pool.Exec(t.Context(), "CREATE TABLE "+ledger+" (operation_id text PRIMARY KEY)")
	require.NoError(t, err)
	key1, key2 := sealKey(1), sealKey(2)
	tx1, err := seal.NewTx(oc, seal.Keys{Current: key1})
	require.NoError(t, err)
	k := idempotency.Key{Scope: "acct_1", Name: "one-commit"}
	var seen string
	charge := func(fail bool) func(ctx context.Context) (idempotency.Response, error) {
		return func(ctx context.Context) (idempotency.Response, error) {
			info, _ := idempotency.FromContext(ctx)
			seen = info.OperationID
			tx, ok := postgres.TxFromContext(ctx)
			if !ok {
				return idempotency.Response{}, errors.New("no transaction: not the one-commit mode")
			}
			if _, err := tx.Exec(ctx, "INSERT INTO "+ledger+" VALUES ($1)", info.OperationID); err != nil {
				return idempotency.Response{}, err
			}
			if fail {
				return idempotency.Response{}, errSealStep
			}
			return sealResponse("ch_1"), nil
		}
	}
	g1 := idempotency.New(tx1, idempotency.Options{})
	_, err = g1.Do(t.Context(), k, sealRequest, charge(true))
	require.ErrorIs(t, err, errSealStep)
	_, rows := sealLeaks(t, r.pool, table)
	assert.Zero(t, rows, "a failed operation leaves no record")
	first, err := g1.Do(t.Context(), k, sealRequest, charge(false))
	require.NoError(t, err)
	assert.False(t, first.Replayed)
	assert.Equal(t, sealResponse("ch_1"), first.Response)
	assert.Equal(t, seen, first.OperationID, "the operation sees the caller's operation ID")
	assert.NotContains(t, first.OperationID, "~k")
	var charged string
	require.NoError(t, r.pool.QueryRow(t.Context(), "SELECT string_agg(operation_id, ',') FROM "+ledger).Scan(&charged))
	assert.Equal(t, first.OperationID, charged, "one business row, committed with the record")
	leaks, rows := sealLeaks(t, r.pool, table)
	assert.Empty(t, leaks)
	assert.Equal(t, 1, rows)

	tx2, err := seal.NewTx(oc, seal.Keys{Current: key2, Earlier: []seal.Key{key1}})
	require.NoError(t, err)
	for _, g := range []*idempotency.Guard{g1, idempotency.New(tx2, idempotency.Options{})} {
		res, err := g.Do(t.Context(), k, sealRequest, sealMustNotRun(t))
		require.NoError(t, err)
		assert.True(t, res.Replayed)
		assert.Equal(t, sealResponse("ch_1"), res.Response)
		assert.Equal(t, first.OperationID, res.OperationID)
		_, err = g.Do(t.Context(), k, idempotency.FingerprintOf("POST /v1/charges", []byte("another")), sealMustNotRun(t))
		require.ErrorIs(t, err, idempotency.ErrMismatch)
	}
	tx3, err := seal.NewTx(oc, seal.Keys{Current: key2})
	require.NoError(t, err)
	_, err = idempotency.New(tx3, idempotency.Options{}).Do(t.Context(), k, sealRequest, sealMustNotRun(t))
	require.ErrorIs(t, err, seal.ErrUnknownKey)
}
