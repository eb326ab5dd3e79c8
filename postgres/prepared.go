package postgres

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/idempotency-go/idempotency"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// An owner's write is one round trip on any connection, as the lease needs,
// and runs a prepared statement, which spares the server parsing and
// planning it on every call: on a connection that has not prepared it yet,
// the statement is prepared and executed in one pipeline. A pool whose
// query mode is not pgx's default (a pool set up for a transaction-pooling
// proxy, which may not keep prepared statements) has the statement sent
// unprepared instead, also in one round trip.

// ownerStatement is an owner's statement of one Store, with its parameters'
// types in order. It never changes once made.
type ownerStatement struct {
	sql    string
	name   string // the prepared statement's name, from sql
	oids   []uint32
	binary []int16 // the format of every parameter and result
}

// newOwnerStatement returns sql as an owner's statement whose parameters are
// the key's scope and name and the token, then parameters of the types
// oids.
func newOwnerStatement(sql string, oids ...uint32) *ownerStatement {
	sum := sha256.Sum256([]byte(sql))
	return &ownerStatement{sql: sql, name: "idempotency_" + hex.EncodeToString(sum[:12]),
		oids:   append([]uint32{pgtype.TextOID, pgtype.TextOID, pgtype.Int8OID}, oids...),
		binary: []int16{pgtype.BinaryFormatCode}}
}

// errNotPrepared is the SQLSTATE of a prepared statement the connection
// does not have: its execution was refused before it ran.
const errNotPrepared = "26000"

// ownerConn is a connection an owner's statement runs on, which its caller
// holds, and whether statements may be prepared on it: only in pgx's
// default query mode.
type ownerConn struct {
	*pgx.Conn
	prepare bool
}

// prepares reports whether a connection configured by cfg keeps prepared
// statements.
func prepares(cfg *pgx.ConnConfig) bool {
	return cfg.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement
}

// exec runs st for the owner of k's record with token, and args after
// them, on conn, and returns how many rows it changed.
func (st *ownerStatement) exec(ctx context.Context, conn ownerConn, k idempotency.Key, token uint64, args []any) (int64, error) {
	args = ownerArgs(k, token, args)
	if !conn.prepare {
		tag, err := conn.Exec(ctx, st.sql, append([]any{pgx.QueryExecModeExec}, args...)...)
		return tag.RowsAffected(), err
	}
	res := st.run(ctx, conn, args)
	return res.CommandTag.RowsAffected(), res.Err
}

// queryRow is exec for a statement that answers one row: it scans the
// row's columns into dest.
func (st *ownerStatement) queryRow(ctx context.Context, conn ownerConn, k idempotency.Key, token uint64, args []any, dest ...any) error {
	args = ownerArgs(k, token, args)
	if !conn.prepare {
		return conn.QueryRow(ctx, st.sql, append([]any{pgx.QueryExecModeExec}, args...)...).Scan(dest...)
	}
	return scanOne(conn.TypeMap(), st.run(ctx, conn, args), dest)
}

// ownerArgs are the arguments of an owner's statement. The sequence issues
// tokens from 1 up to MaxInt64: a token beyond it turns negative here,
// matches no row, and so is fenced off.
func ownerArgs(k idempotency.Key, token uint64, args []any) []any {
	return append([]any{k.Scope, k.Name, int64(token)}, args...)
}

// run runs st prepared on conn with args.
func (st *ownerStatement) run(ctx context.Context, conn ownerConn, args []any) *pgconn.Result {
	params, err := st.encode(conn.TypeMap(), args)
	if err != nil {
		return &pgconn.Result{Err: err}
	}
	pc := conn.PgConn()
	if sd, ok := pc.CustomData()[st.name].(*pgconn.StatementDescription); ok {
		res := pc.ExecStatement(ctx, sd, params, st.binary, st.binary).Read()
		var pgErr *pgconn.PgError
		if !errors.As(res.Err, &pgErr) || pgErr.Code != errNotPrepared || pc.TxStatus() != 'I' {
			return res
		}
		// The statement was deallocated behind the Store's back (DISCARD
		// ALL, say), outside a transaction, and nothing ran: prepare it
		// again.
		delete(pc.CustomData(), st.name)
	}
	return st.prepareAndExecute(ctx, pc, params)
}

// encode encodes args in binary, each as its parameter's type.
func (st *ownerStatement) encode(m *pgtype.Map, args []any) ([][]byte, error) {
	if len(args) != len(st.oids) {
		return nil, fmt.Errorf("%d arguments for %d parameters", len(args), len(st.oids))
	}
	params := make([][]byte, len(args))
	for i, a := range args {
		// A buffer that is not nil: an empty value (the empty scope) comes
		// back empty, not nil, which would send NULL.
		b, err := m.Encode(st.oids[i], pgtype.BinaryFormatCode, a, []byte{})
		if err != nil {
			return nil, fmt.Errorf("parameter %d: %w", i+1, err)
		}
		params[i] = b
	}
	return params, nil
}

// prepareAndExecute prepares st on pc and runs it, in one round trip, and
// keeps the prepared statement's description on pc for the next calls.
func (st *ownerStatement) prepareAndExecute(ctx context.Context, pc *pgconn.PgConn, params [][]byte) *pgconn.Result {
	p := pc.StartPipeline(ctx)
	p.SendPrepare(st.name, st.sql, st.oids)
	p.SendQueryPrepared(st.name, params, st.binary, st.binary)
	res := &pgconn.Result{Err: p.Sync()}
	if res.Err == nil {
		res = st.pipelineResult(pc, p)
	}
	if err := p.Close(); err != nil && res.Err == nil {
		res.Err = err
	}
	return res
}

// pipelineResult reads the answers to prepareAndExecute's pipeline p on pc
// up to its sync.
func (st *ownerStatement) pipelineResult(pc *pgconn.PgConn, p *pgconn.Pipeline) *pgconn.Result {
	r, err := p.GetResults()
	if err != nil {
		return &pgconn.Result{Err: err}
	}
	if sd, ok := r.(*pgconn.StatementDescription); ok {
		sd.Name, sd.SQL = st.name, st.sql // a pipeline's description names neither
		pc.CustomData()[st.name] = sd
	}
	if r, err = p.GetResults(); err != nil {
		return &pgconn.Result{Err: err}
	}
	rr, ok := r.(*pgconn.ResultReader)
	if !ok {
		return &pgconn.Result{Err: fmt.Errorf("the pipeline answered %T, not rows", r)}
	}
	res := rr.Read()
	if res.Err == nil {
		_, res.Err = p.GetResults() // the sync
	}
	return res
}

// scanOne scans res's one row, in binary, into dest: pgx.ErrNoRows when it
// has none.
func scanOne(m *pgtype.Map, res *pgconn.Result, dest []any) error {
	switch {
	case res.Err != nil:
		return res.Err
	case len(res.Rows) == 0:
		return pgx.ErrNoRows
	case len(res.Rows) != 1:
		return fmt.Errorf("%d rows where one was due", len(res.Rows))
	case len(res.Rows[0]) != len(dest) || len(res.FieldDescriptions) != len(dest):
		return fmt.Errorf("%d columns where %d were due", len(res.Rows[0]), len(dest))
	}
	for i, d := range dest {
		err := m.Scan(res.FieldDescriptions[i].DataTypeOID, pgtype.BinaryFormatCode, res.Rows[0][i], d)
		if err != nil {
			return fmt.Errorf("column %d: %w", i+1, err)
		}
	}
	return nil
}
