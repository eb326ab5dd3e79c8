package idempotency_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/idempotency-go/idempotency"
)

// An operation of three steps whose first attempt fails at the receipt:
// the retry resumes there, with the order and the charge it recorded, and
// runs neither again.
func ExampleStep() {
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	k := idempotency.Key{Scope: "acct_42", Name: "order-7"}
	fp := idempotency.FingerprintOf("POST /orders", []byte(`{"sku":"tea","amount":1200}`))
	mailDown := true
	placeOrder := func(ctx context.Context) (idempotency.Response, error) {
		order, err := idempotency.Step(ctx, "order", func(ctx context.Context) (string, error) {
			fmt.Println("insert the order row")
			return "ord_1", nil
		})
		if err != nil {
			return idempotency.Response{}, err
		}
		charge, err := idempotency.Step(ctx, "charge", func(ctx context.Context) (string, error) {
			fmt.Println("charge the card for", order)
			return "ch_1", nil
		})
		if err != nil {
			return idempotency.Response{}, err
		}
		_, err = idempotency.Step(ctx, "receipt", func(ctx context.Context) (bool, error) {
			if mailDown {
				return false, errors.New("mail server down")
			}
			fmt.Println("send the receipt for", charge)
			return true, nil
		})
		if err != nil {
			return idempotency.Response{}, err
		}
		return idempotency.Response{Status: 201, Body: []byte(order + " " + charge)}, nil
	}

	_, err := guard.Do(context.Background(), k, fp, placeOrder)
	fmt.Println("first attempt:", err)
	mailDown = false
	res, err := guard.Do(context.Background(), k, fp, placeOrder)
	fmt.Println("retry:", res.Response.Status, string(res.Response.Body), err)
	// Output:
	// insert the order row
	// charge the card for ord_1
	// first attempt: mail server down
	// send the receipt for ch_1
	// retry: 201 ord_1 ch_1 <nil>
}
