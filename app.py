"""specviz's page: `python app.py` here, and a Space's app_file. The layout and its wiring are in
specviz/page/app.py (installed, `specviz-page` starts the same page)."""

from specviz.page.app import main

if __name__ == "__main__":
    main()
