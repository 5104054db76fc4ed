module github.com/kvrouter/kvrouter/bindings/go

go 1.21
