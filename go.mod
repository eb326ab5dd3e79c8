module github.com/idempotency-go/idempotency

go 1.26.0

require github.com/gowebpki/jcs v1.0.2

require (
	github.com/stretchr/testify v1.12.1
	go.yaml.in/yaml/v3 v3.0.5 // indirect
)
