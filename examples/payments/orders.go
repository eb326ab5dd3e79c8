package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

// order is a customer's order for a charge: the first step of a charge.
type order struct {
	ID        string `json:"id"`
	Operation string `json:"operation"` // the idempotency operation that placed it
	Attempt   int    `json:"attempt"`   // the attempt at that operation that placed it
	Amount    int64  `json:"amount"`
	Currency  string `json:"currency"`
	Source    string `json:"source"`
}

// receipt is what the customer is sent once the card is charged: the last
// step of a charge.
type receipt struct {
	ID        string `json:"id"`
	Operation string `json:"operation"` // the idempotency operation that sent it
	Attempt   int    `json:"attempt"`   // the attempt at that operation that sent it
	Order     string `json:"order"`
	Charge    string `json:"charge"`
	Amount    int64  `json:"amount"`
	Currency  string `json:"currency"`
}

// orders keeps every order placed, one row per call of place: it does not
// de-duplicate, so an order placed twice is there twice.
type orders interface {
	place(ctx context.Context, o order) error
	// placedBy returns the order the operation placed, and false if none.
	placedBy(ctx context.Context, operation string) (order, bool, error)
}

// transactionalOrders is an orders table in the idempotency store's own
// database.
type transactionalOrders interface {
	// placeRecorded places o and, in the same transaction, records it as
	// the result of the step whose function runs in ctx.
	placeRecorded(ctx context.Context, o order) error
}

// receipts is the service that sends receipts. It keeps every receipt sent,
// one row per call of send, and does not de-duplicate either.
type receipts interface {
	send(ctx context.Context, r receipt) error
	// sentFor returns the receipt the operation sent, and false if none.
	sentFor(ctx context.Context, operation string) (receipt, bool, error)
}

func newID(prefix string) string { return prefix + strings.ToLower(rand.Text()) }

// Redis keys of the orders and the receipts: each a list of every row,
// beside a hash of the rows by operation (see byOperation).
const (
	ordersKey   = "payments:{orders}"
	receiptsKey = "payments:{receipts}"
)

// byOperation is the key of the hash that indexes the rows of the list at
// key by their operation. It shares key's hash tag.
func byOperation(key string) string { return key + ":by-operation" }

func (b *redisBackend) place(ctx context.Context, o order) error {
	return b.appendRow(ctx, ordersKey, o.Operation, o)
}

func (b *redisBackend) placedBy(ctx context.Context, operation string) (order, bool, error) {
	return redisRowOf[order](ctx, b.c, ordersKey, operation)
}

func (b *redisBackend) send(ctx context.Context, r receipt) error {
	return b.appendRow(ctx, receiptsKey, r.Operation, r)
}

func (b *redisBackend) sentFor(ctx context.Context, operation string) (receipt, bool, error) {
	return redisRowOf[receipt](ctx, b.c, receiptsKey, operation)
}

// appendRow appends row to the list at key and indexes it under operation,
// in one MULTI/EXEC: a row is in both or in neither.
func (b *redisBackend) appendRow(ctx context.Context, key, operation string, row any) error {
	enc, err := json.Marshal(row)
	if err != nil {
		return err
	}
	_, err = b.c.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.RPush(ctx, key, enc)
		p.HSet(ctx, byOperation(key), operation, enc)
		return nil
	})
	return err
}

// redisRowOf returns the row of operation in the index of the list at key.
func redisRowOf[T any](ctx context.Context, c redis.UniversalClient, key, operation string) (T, bool, error) {
	var row T
	enc, err := c.HGet(ctx, byOperation(key), operation).Bytes()
	switch {
	case errors.Is(err, redis.Nil):
		return row, false, nil
	case err != nil:
		return row, false, err
	}
	return row, true, json.Unmarshal(enc, &row)
}

func (b *postgresBackend) place(ctx context.Context, o order) error {
	return placeIn(ctx, b.pool, o)
}

func (b *postgresBackend) placeRecorded(ctx context.Context, o order) error {
	// Committed with the operation's context: a transaction still open when
	// the lease ends locally rolls back, and then neither the order nor its
	// step was recorded.
	return pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		if err := placeIn(ctx, tx, o); err != nil {
			return err
		}
		return b.store.StepTx(ctx, tx, o)
	})
}

func placeIn(ctx context.Context, q execer, o order) error {
	_, err := q.Exec(ctx, `INSERT INTO payments_orders (operation, body) VALUES ($1, $2)`, o.Operation, o)
	return err
}

func (b *postgresBackend) placedBy(ctx context.Context, operation string) (order, bool, error) {
	return postgresRowOf[order](ctx, b, "payments_orders", operation)
}

func (b *postgresBackend) send(ctx context.Context, r receipt) error {
	_, err := b.pool.Exec(ctx, `INSERT INTO payments_receipts (operation, body) VALUES ($1, $2)`, r.Operation, r)
	return err
}

func (b *postgresBackend) sentFor(ctx context.Context, operation string) (receipt, bool, error) {
	return postgresRowOf[receipt](ctx, b, "payments_receipts", operation)
}

// postgresRowOf returns the body of a row of operation in table.
func postgresRowOf[T any](ctx context.Context, b *postgresBackend, table, operation string) (T, bool, error) {
	var row T
	err := b.pool.QueryRow(ctx, fmt.Sprintf(`SELECT body FROM %s WHERE operation = $1 LIMIT 1`, table), operation).Scan(&row)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return row, false, nil
	case err != nil:
		return row, false, err
	}
	return row, true, nil
}
