package seal_test

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"log"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/seal"
)

// secret decodes a key's 32 secret bytes, as a service would read them
// from its secret manager: `openssl rand -base64 32` makes one.
func secret(b64 string) [32]byte {
	var s [32]byte
	b, err := base64.StdEncoding.DecodeString(b64)
	if err != nil || len(b) != len(s) {
		log.Fatal("a sealing key is 32 bytes in base64")
	}
	copy(s[:], b)
	return s
}

// A Guard over a sealed store: the client's retry replays as before, while
// the store keeps the response sealed. After a rotation (key 2 current, key
// 1 still configured) the record sealed under key 1 still replays; once key
// 1 is removed, it is refused, and the operation does not run again.
func Example() {
	ctx := context.Background()
	inner := idempotency.NewMemoryStore(idempotency.MemoryOptions{}) // or a RedisStore, or postgres.New
	// Example secrets: a service's own come from its secret manager.
	key1 := seal.Key{ID: 1, Secret: secret("3q2+7wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=")}
	key2 := seal.Key{ID: 2, Secret: secret("yv66vgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=")}
	store, err := seal.New(inner, seal.Keys{Current: key1})
	if err != nil {
		log.Fatal(err)
	}
	guard := idempotency.New(store, idempotency.Options{})

	k := idempotency.Key{Scope: "acct_42", Name: "charge-7"}
	fp := idempotency.FingerprintOf("POST /v1/charges", []byte(`{"amount":1200,"card":"4242"}`))
	charge := func(ctx context.Context) (idempotency.Response, error) {
		fmt.Println("charge the card")
		return idempotency.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}, nil
	}
	_, _ = guard.Do(ctx, k, fp, charge)
	res, _ := guard.Do(ctx, k, fp, charge)
	fmt.Println("retry:", res.Response.Status, string(res.Response.Body), "replayed:", res.Replayed)

	rec, _ := store.Inspect(ctx, k)
	fmt.Println("an operator sees:", rec.State, rec.Status, rec.BodySize, "bytes")

	rotated, _ := seal.New(inner, seal.Keys{Current: key2, Earlier: []seal.Key{key1}})
	res, _ = idempotency.New(rotated, idempotency.Options{}).Do(ctx, k, fp, charge)
	fmt.Println("after the rotation:", string(res.Response.Body), "replayed:", res.Replayed)

	removed, _ := seal.New(inner, seal.Keys{Current: key2})
	_, err = idempotency.New(removed, idempotency.Options{}).Do(ctx, k, fp, charge)
	fmt.Println("key 1 removed:", errors.Is(err, seal.ErrUnknownKey), err)
	// Output:
	// charge the card
	// retry: 201 {"id":"ch_1"} replayed: true
	// an operator sees: completed 201 13 bytes
	// after the rotation: {"id":"ch_1"} replayed: true
	// key 1 removed: true seal: sealed under a key that is not configured: key ID 1 made the fingerprint of the record of {acct_42 charge-7}
}
